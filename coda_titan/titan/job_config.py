"""The ``[coda]`` TOML section: the one schema of every knob, merged into TorchTitan's JobConfig
through ``job.custom_config_module = "coda_titan.titan.job_config"`` (``coda-titan`` adds it).

Each field declares its type, default, allowed values or range and a one-line doc (``knob``).
``validate`` checks a parsed section against it; the CLI calls it before anything is built, and
the model calls it again, so a config run through TorchTitan's own launcher is checked too. The
README's ``[coda]`` table is generated from it (``markdown_table``). (No ``from __future__ import
annotations`` here: TorchTitan's config merger resolves these annotations in another module.)
"""


import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional


class ConfigError(ValueError):
    """A ``[coda]`` value the schema refuses; the message is one line naming key, value and what is allowed."""


def knob(default, doc: str, *, choices: Optional[tuple] = None, low: Optional[int] = None, high: Optional[int] = None):
    """A ``[coda]`` field: its default, a one-line doc, and the allowed values or integer range."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "low": low, "high": high})


@dataclass
class Coda:
    backend: str = knob(
        "auto", "`cute`: fused SM90 kernels (H100/H200, the gpu extra); `torch`: the plain-PyTorch reference "
        "(any device); `auto`: cute where it can run",
        choices=("auto", "torch", "cute"),
    )
    tile_n: int = knob(128, "column-tile width of the partial RMS sums S (reference programs)", low=1)
    ce_chunk_rows: int = knob(
        4096, "token rows per chunk of the LM head + CE: logits held at once = rows x vocab", low=1
    )
    precision: str = knob(
        "bf16", "GEMM operands: `fp8` = e4m3 / e5m2, tensorwise scales (docs/fp8.md)",
        choices=("bf16", "fp8"),
    )
    fp8_amax_history: int = knob(16, "fp8: steps of per-site amax history behind the delayed scales", low=1)
    fp8_dgrad: bool = knob(True, "fp8: QKV dgrad on B1's delayed e5m2 da (a delayed scale)")
    fp8_mlp_dgrad: bool = knob(True, "fp8: the W13 dgrad on an e5m2 gradient with a delayed scale")
    fp8_mlp_wgrad: bool = knob(True, "fp8: dW13 on fp8 (torchao's recipe, power-of-two scales)")
    fp8_mlp_wgrad_e5m2: bool = knob(True, "fp8: dW13 reads B3's e5m2 da; no bf16 da is written")
    fp8_down_proj: bool = knob(True, "fp8: the W2 forward on fp8, F2 writing e4m3 y (delayed scale)")
    fp8_out_proj: bool = knob(True, "fp8: the W_o forward on fp8, its input cast to e4m3 (delayed scale)")
    fp8_mlp_da_t: bool = knob(True, "fp8: B3 also writes da^T (and y^T): no copy for dW13 (dW2)")
    fp8_down_wgrad: bool = knob(True, "fp8: dW2 on B3's e4m3 y (y^T with fp8_mlp_da_t)")
    fp8_mlp_h_t: bool = knob(False, "fp8: dW13 on F1's e4m3 H^T, no bf16 H; on in 1B fp8 configs")
    fp8_qkv_wgrad: bool = knob(False, "fp8: dW_qkv on e4m3 H, da at its current amax; on in 1B fp8 configs")
    fp8_preact: bool = knob(False, "fp8: F2 saves a for B3 as e4m3, not bf16; on in 1B fp8 configs")
    fp8_lm_head: bool = knob(False, "fp8: the LM head on e4m3 H, W and e5m2 dlogits; faster, off loss parity")
    fp8_lm_head_fwd: bool = knob(False, "fp8: the LM head's logits on e4m3 H, W; its gradient bf16")
    fp8_lm_head_dw: bool = knob(False, "fp8_lm_head_fwd: dW_out on e5m2 dlogits (rounded stochastically)")
    fp8_lm_head_dgrad: bool = knob(False, "fp8_lm_head_dw: the dgrad on those codes too")
    fp8_out_bwd: bool = knob(True, "fp8: W_o's dgrad and wgrad on one e5m2 cast of dX")
    fp8_weight_t_bwd: bool = knob(False, "fp8: the dgrads' e4m3 W^T made in the backward, not held (8B: less memory, slower)")
    fp8_down_dgrad: bool = knob(True, "fp8: B3's GEMM on fp8 (e5m2 D, e4m3 W2^T), with fp8_mlp_dgrad's e5m2 B3")
    fp8_layer_wgrads: bool = knob(False, "fp8: dW_qkv, dW_o, dW2 on fp8 with cast passes (1% slower)")
    trace_passes: bool = knob(True, "cute + compile: B1 and plain gradient GEMMs traced into the graph")
    prefetch_weights: bool = knob(True, "fp8: the next weight pass issued at the optimizer step, on a side stream")
    cuda_graphs: bool = knob(False, "compile: blocks as CUDA graphs; one GPU, no AC; measured level")
    optimizer_stream: bool = knob(False, "the optimizer step on its own CUDA stream (one GPU)")
    input_stream: bool = knob(False, "the batch's GPU copies on their own CUDA stream")
    step_chunk_layers: int = knob(0, "optimizer_stream: the step in chunks of N layers, each awaited by its blocks", low=0)
    fused_clip: bool = knob(False, "the grad clip's scale applied in fused AdamW; one device")
    coda_adamw: bool = knob(False, "AdamW in one Triton launch, torch's bits; one device; on in 8B configs")
    stacked_weights: bool = knob(False, "bf16: wq+wk+wv, w1+w3 in one buffer each, no copies; off until GPU-tested")
    b2_c_stages: int = knob(2, "cute: B2's and bf16 B3's epilogue C-load stage base (0: quack's, 4)", low=0, high=4)
    fp8_grad_margin: int = knob(
        8, "fp8_mlp_dgrad: headroom of the delayed e5m2 gradient scale, as a power of two", low=0, high=24
    )
    fp8_act_margin: int = knob(1, "fp8: headroom of the delayed e4m3 input scales, as a power of two", low=0, high=8)


def _show_docs_in_help(cls) -> None:
    """``coda-titan train CONFIG --help`` (TorchTitan's tyro parser) prints each knob's doc: the
    annotations tyro reads get the doc attached (the dataclass fields keep their plain types)."""
    import tyro

    for f in dataclasses.fields(cls):
        cls.__annotations__[f.name] = Annotated[f.type, tyro.conf.arg(help=f"{f.metadata['doc']}; {_allowed(f)}")]


@dataclass
class JobConfig:
    coda: Coda = field(default_factory=Coda)


def _allowed(f: dataclasses.Field) -> str:
    m = f.metadata
    if m["choices"]:
        return "one of " + ", ".join(repr(c) for c in m["choices"])
    if f.type is bool:
        return "true or false"
    low, high = m["low"], m["high"]
    if low is not None and high is not None:
        return f"an integer in {low}..{high}"
    if low is not None:
        return f"an integer >= {low}"
    return f"a {f.type.__name__}"


def _ok(f: dataclasses.Field, value: Any) -> bool:
    m = f.metadata
    kind = f.type
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        return False
    if m["choices"] and value not in m["choices"]:
        return False
    if m["low"] is not None and value < m["low"]:
        return False
    return m["high"] is None or value <= m["high"]


FIELDS = {f.name: f for f in dataclasses.fields(Coda)}
_show_docs_in_help(Coda)


def validate_table(table: dict) -> None:
    """Raise ConfigError for the first key or value of a raw ``[coda]`` table the schema refuses."""
    for key, value in table.items():
        f = FIELDS.get(key)
        if f is None:
            raise ConfigError(f"unknown key {key!r} in [coda]; valid keys: {', '.join(FIELDS)}")
        if not _ok(f, value):
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ConfigError(f"[coda] {key} = {shown} is not allowed: use {_allowed(f)}")


def validate(coda: Coda) -> Coda:
    """Raise ConfigError for the first value of ``coda`` the schema refuses, or a combination that
    would do nothing; return ``coda`` unchanged."""
    validate_table({name: getattr(coda, name) for name in FIELDS})
    for knob, (needs, why) in NEEDS.items():
        unmet = {k: v for k, v in needs.items() if getattr(coda, k) != v} if getattr(coda, knob) else {}
        if unmet:
            raise ConfigError(f"[coda] {knob} = true needs {_settings(needs)} ({why}); got {_settings(unmet, coda)}")
    return coda


# The off-by-default knobs and the settings they act through: without them each would do nothing, so
# a run that sets it is refused before it starts. (The on-by-default variants, fp8_mlp_wgrad_e5m2,
# fp8_mlp_da_t, fp8_down_wgrad, fp8_down_dgrad and fp8_out_bwd, are ignored where what they vary does not run.)
NEEDS = {
    "fp8_layer_wgrads": ({"precision": "fp8"}, "it runs weight gradients on fp8"),
    "fp8_qkv_wgrad": ({"precision": "fp8"}, "it runs dW_qkv on fp8"),
    "fp8_lm_head": ({"precision": "fp8"}, "it runs the LM head on fp8"),
    "fp8_lm_head_fwd": ({"precision": "fp8", "fp8_lm_head": False},
                        "it runs the LM head's forward on fp8, and fp8_lm_head runs all of the head on it"),
    "fp8_lm_head_dw": ({"precision": "fp8", "fp8_lm_head_fwd": True}, "it runs the fp8 forward head's dW on fp8"),
    "fp8_lm_head_dgrad": ({"precision": "fp8", "fp8_lm_head_fwd": True, "fp8_lm_head_dw": True},
                          "it runs the head's dgrad on fp8_lm_head_dw's codes"),
    "fp8_mlp_h_t": ({"precision": "fp8", "fp8_mlp_dgrad": True, "fp8_mlp_wgrad": True, "fp8_mlp_wgrad_e5m2": True,
                     "fp8_out_proj": True}, "the out-projection's fp8 F1 writes H^T for the e5m2-only B3's dW13"),
    "fp8_preact": ({"precision": "fp8", "fp8_mlp_dgrad": True, "fp8_mlp_wgrad": True, "fp8_mlp_wgrad_e5m2": True,
                    "fp8_mlp_da_t": True, "fp8_down_dgrad": True, "fp8_down_proj": True},
                   "the fp8 B3 with da^T reads a's codes; F2 writes them beside its e4m3 y"),
}


def _settings(values: dict, coda: Coda | None = None) -> str:
    """``key = value, ...`` in TOML spelling, of ``values`` (or of ``coda``'s values of those keys)."""
    shown = {k: getattr(coda, k) if coda is not None else v for k, v in values.items()}
    return ", ".join(f"{k} = " + (str(v).lower() if isinstance(v, bool) else f'"{v}"') for k, v in shown.items())


def markdown_table() -> str:
    """The README's ``[coda]`` table: key, default, allowed values, doc."""
    rows = ["| key | default | allowed | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(Coda):
        default = str(f.default).lower() if isinstance(f.default, bool) else repr(f.default).replace("'", '"')
        rows.append(f"| `{f.name}` | `{default}` | {_allowed(f)} | {f.metadata['doc']} |")
    return "\n".join(rows)
