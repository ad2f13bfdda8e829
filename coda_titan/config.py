"""The ``[coda]`` TOML section, merged into TorchTitan's JobConfig via ``job.custom_config_module``.

    [job]
    custom_config_module = "coda_titan.config"

    [coda]
    backend = "auto"        # "auto" | "torch" | "cute"
    tile_n = 128            # column-tile width of the partial RMS sums
    ce_chunk_rows = 4096    # token rows per chunk of the LM head + cross-entropy
    precision = "bf16"      # "bf16" | "fp8" (e4m3 F2/F3 GEMMs, see coda_titan/kernels/fp8.py)
    fp8_amax_history = 16   # steps of activation amax history behind the delayed fp8 scales
    fp8_dgrad = false       # fp8: F3's dgrad (B1 -> B2) on an e5m2 gradient (measured slower, see README)
    fp8_mlp_dgrad = true    # fp8: the MLP's W13 dgrad (B3 -> B2) on an e5m2 gradient, delayed scale
    fp8_mlp_wgrad = true    # fp8: W13's weight gradient on fp8 (torchao's recipe, power-of-two scales)
    fp8_grad_margin = 8     # fp8_mlp_dgrad: log2 headroom of the delayed e5m2 gradient scale
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

    precision: str = "bf16"
    """GEMM operand precision of the programs: "bf16", or "fp8" = e4m3 operands for the QKV (F3) and
    gate/up (F2) GEMMs, tensorwise scales (delayed for activations, current for weights), fp32
    accumulation, bf16 backward. The parameters stay bf16/fp32 either way (same checkpoints)."""

    fp8_amax_history: int = 16
    """precision = "fp8": steps of per-site activation amax history; the scale uses their max."""

    fp8_dgrad: bool = False
    """precision = "fp8": also run F3's dgrad (B1 -> B2) on fp8, an e5m2 gradient with a current scale
    (torchao's treatment of gradients) times the e4m3 W_qkv^T. Off by default: on the H100 at 1B the
    e5m2 cast costs B1 more than the fp8 GEMM saves B2 (README, FP8 kernel table)."""

    fp8_mlp_dgrad: bool = True
    """precision = "fp8": also run the MLP's largest dgrad, da @ W13 (B2 of F2), on fp8: B3's epilogue
    writes da as e5m2 as well, with a delayed scale (the max of the last ``fp8_amax_history`` steps'
    gradient amax; the first backward calibrates with the current amax), and B2 multiplies it with
    the e4m3 W13^T of the weight pass (W13's wgrad: ``fp8_mlp_wgrad``). On by default: measured
    faster than the bf16 MLP dgrad on the H100 (README, FP8), with loss parity inside the float8
    baseline's own noise."""

    fp8_mlp_wgrad: bool = True
    """precision = "fp8": also compute W13's weight gradient dW13 = da^T H on fp8, as torchao's
    float8 weight gradient: da as e5m2 and H as e4m3 with *current* tensorwise scales, whose amaxes
    B3 and F1 already report (no amax pass), rounded down to a power of two (torchao's
    ``round_scales_to_power_of_2``: an element's rounding then does not move with the amax),
    cuBLAS's fp8 GEMM with slow accumulation. SM90 fp8 MMAs
    read K-major operands only and K is the token axis here, so the kernel makes token-major copies
    (one cast-and-transpose pass per operand). The other wgrads stay bf16: without a producer's
    amax, the extra amax pass costs more than the fp8 GEMM saves (``scripts/probe_fp8_wgrad.py``).
    On by default: faster on the H100 at 1B in an A/B training run, with 300-step loss parity inside
    the float8 baseline's own run-to-run spread (README, FP8; docs/fp8_design.md item 6)."""

    fp8_grad_margin: int = 8
    """fp8_mlp_dgrad: headroom of the delayed e5m2 gradient scale, as a power of two: the scale maps
    2**margin times the history's amax to e5m2's largest value, so a step whose gradient grows up to
    2**margin-fold over the history does not saturate. e5m2 spans about 32 binades, so the default
    (256-fold) only moves values below 2**-22 of the amax into its subnormals."""


@dataclass
class JobConfig:
    coda: Coda = field(default_factory=Coda)
