"""The ``[coda]`` TOML section, merged into TorchTitan's JobConfig via ``job.custom_config_module``.

    [job]
    custom_config_module = "coda_titan.config"

    [coda]
    backend = "auto"        # "auto" | "torch" | "cute"
    tile_n = 128            # column-tile width of the partial RMS sums
    ce_chunk_rows = 4096    # token rows per chunk of the LM head + cross-entropy
"""

from dataclasses import dataclass, field


@dataclass
class Coda:
    backend: str = "auto"
    """Program backend: "cute" = fused SM90 kernels (needs an H100/H200 and the gpu extra), "torch" = the
    reference programs in plain PyTorch (any device), "auto" = cute where it can run, else torch."""

    tile_n: int = 128
    """Column-tile width over which the producer epilogue writes partial sums of squares."""

    ce_chunk_rows: int = 4096
    """Token rows per chunk of the LM head + cross-entropy program; logits held at once = rows x vocab."""


@dataclass
class JobConfig:
    coda: Coda = field(default_factory=Coda)
