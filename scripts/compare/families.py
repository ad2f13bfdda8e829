"""GPU time per GEMM family of one profiled training step: QKV, attention output, W13 (gate/up), W2
(down), LM head, each forward, dgrad and wgrad, the same way for CODA and for stock TorchTitan, so
that a step can be set against its floor family by family.

A kernel belongs to the GEMM family of the operator that launched it (the torch profiler's
correlation id links a kernel to its launch, and the host thread's operator stack at the launch names
the operators around it):
- CODA: the program's custom op (``coda::norm_rope`` is the QKV forward, ``coda::swiglu_bwd`` the W2
  dgrad, ...), every kernel it launches included (its epilogue is that GEMM's cost); programs shared
  by two families (F1, B2, the plain wgrad / dgrad) are told apart by their operand shapes, and so are
  the plain GEMMs traced into a compiled graph (``CODA_WEIGHTS``).
- stock: ``aten::mm`` / ``addmm`` / ``_scaled_mm`` by operand shapes against the model's weights.
  Two ambiguities remain there: forward and backward GEMMs of equal shapes (W1's forward is W2's
  dgrad), resolved by the second operand's strides where the trace records them (a forward's is the
  weight's transposed view; a dgrad's the weight, a wgrad's the input, both row-major), so that a
  forward recomputed inside the backward (activation checkpointing) stays a forward, else (and for
  ``_scaled_mm``, whose operands are column-major either way) by whether the LM head's backward has
  started; and W_q against W_o (both d x d) by where the GEMM falls relative to the layer's attention
  kernel and MLP GEMMs.
"""

from __future__ import annotations

import bisect
import json

FAMILIES = ("qkv", "out", "w13", "w2", "lm_head")
DIRECTIONS = ("fwd", "dgrad", "wgrad")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::_scaled_mm", "aten::bmm")
# CODA programs and the GEMM each one is; None: told apart by shapes (see _coda_family)
CODA_PROGRAMS = {
    "norm_rope": ("qkv", "fwd"), "norm_swiglu": ("w13", "fwd"), "swiglu_bwd": ("w2", "dgrad"),
    "lm_head_ce": ("lm_head", "all"), "residual_rms": None, "norm_residual_bwd": None, "wgrad": None,
    "dgrad": None,
}


# A CODA step's GEMMs outside its programs (the plain weight and input gradients; traced into the
# compiled backward with ``trace_passes``, then ``aten::mm`` / ``_scaled_mm`` there): every forward is a
# program, so they are wgrads (contracting over the tokens) of CODA's fused weights or W_o's dgrad (rows:
# the tokens; every other dgrad is a program); the step's token count is F3's (``norm_rope``'s H: (T, d))
CODA_WEIGHTS = ("qkv", "wo", "w13", "w2", "lm_head")


def model_weights(flavor: str) -> dict[str, tuple[int, int]]:
    """(N_out, K_in) of every layer weight of the flavor as both models hold them (stock: wq, wk, wv,
    wo, w1, w3, w2; CODA's fused views: qkv, w13) and of the LM head."""
    from scripts.bench.floor import _model

    a, ff, _ = _model(flavor)
    hd = a.dim // a.n_heads
    q, kv = a.n_heads * hd, a.n_kv_heads * hd
    return {"wq": (q, a.dim), "wk": (kv, a.dim), "wv": (kv, a.dim), "wo": (a.dim, q), "w1": (ff, a.dim),
            "w3": (ff, a.dim), "w2": (a.dim, ff), "qkv": (q + 2 * kv, a.dim), "w13": (2 * ff, a.dim),
            "lm_head": (a.vocab_size, a.dim)}


_FAMILY_OF = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "qkv": "qkv", "wo": "out", "w1": "w13", "w3": "w13",
              "w13": "w13", "w2": "w2", "lm_head": "lm_head"}


def _two_d(dims) -> list[list[int]]:
    return [d for d in (dims or []) if isinstance(d, list) and len(d) == 2]


def gemm_matches(dims, weights: dict) -> set[tuple[str, str]]:
    """Every (weight, direction) a GEMM of these operand dims can be: forward (T, K) x (K, N), dgrad
    (T, N) x (N, K), wgrad (N, T) x (T, K), for a weight (N, K)."""
    mats = _two_d(dims)[:2]  # (addmm's bias is 1-D, _scaled_mm's scales 0-D or after the operands)
    if len(mats) != 2:
        return set()
    (a0, a1), (b0, b1) = mats
    out = set()
    for name, (n, k) in weights.items():
        if a1 == k and b1 == n and b0 == k:
            out.add((name, "fwd"))
        if a1 == n and b0 == n and b1 == k:
            out.add((name, "dgrad"))
        if a0 == n and b1 == k and a1 == b0:
            out.add((name, "wgrad"))
    return out


def _program_base(program: str) -> str:
    """A program's family name without its precision and layout variants (``residual_rms_q_fp8``: F1 on
    an fp8 mainloop writing e4m3 H is F1; ``swiglu_bwd_e5m2_t_q``, ``wgrad_fp8_e5m2``, ...)."""
    base = None
    while base != program:
        base = program
        for suffix in ("_fp8", "_e5m2", "_q", "_t"):
            program = program.removesuffix(suffix)
    return program


def second_operand_transposed(op: dict) -> bool | None:
    """Whether a bf16 ``aten::mm`` / ``addmm``'s second operand is a transposed (column-major) view, as a
    forward's W^T is, from the trace's Input Strides; None where they are not recorded or say neither."""
    if op["name"] not in ("aten::mm", "aten::addmm"):
        return None
    strides = _two_d(op.get("args", {}).get("Input Strides"))[:2]
    if len(strides) != 2 or len(_two_d(op.get("args", {}).get("Input Dims"))) < 2:
        return None
    s0, s1 = strides[1]
    return True if s0 == 1 and s1 != 1 else False if s1 == 1 and s0 != 1 else None


def _coda_family(program: str, dims, weights: dict) -> tuple[str, str] | None:
    """The GEMM of a CODA program call, from its name and, where two families share the program,
    its first operands' shapes."""
    base = _program_base(program)
    if base not in CODA_PROGRAMS:
        return None
    if CODA_PROGRAMS[base] is not None:
        return CODA_PROGRAMS[base]
    mats = _two_d(dims)
    if not mats:
        return None
    if base == "residual_rms":  # F1: y (T, K) @ W^T, K = d (attention output) or the FFN width (W2)
        return ("out", "fwd") if mats[0][1] == weights["wo"][1] else ("w2", "fwd") if mats[0][1] == weights["w2"][1] else None
    if base == "norm_residual_bwd":  # B2: da (T, N) @ W, N = the QKV width or 2 x FFN
        n = mats[0][1]
        return ("qkv", "dgrad") if n == weights["qkv"][0] else ("w13", "dgrad") if n == weights["w13"][0] else None
    if base == "wgrad" and len(mats) >= 2:  # grad (T, N), input (T, K)
        n, k = mats[0][1], mats[1][1]
        hit = [f for f, w in weights.items() if w == (n, k) and f in ("qkv", "wo", "w13", "w2", "lm_head")]
        return (_FAMILY_OF[hit[0]], "wgrad") if hit else None
    if base == "dgrad" and len(mats) >= 2:  # grad (T, N), weight (N, K)
        hit = [f for f, w in weights.items() if w == tuple(mats[1]) and f in ("wo", "qkv", "w13", "w2", "lm_head")]
        return (_FAMILY_OF[hit[0]], "dgrad") if hit else None
    return None


def _launch_stacks(events: list[dict], cats: tuple[str, ...] = ("cpu_op",)) -> dict[int, list[dict]]:
    """correlation id -> the host operators (events of ``cats``; profiler steps left out) open at that
    kernel's launch, outermost first."""
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})]
    ops = [e for e in events if e.get("cat") in cats and "dur" in e and not str(e.get("name", "")).startswith("ProfilerStep")]
    by_tid: dict = {}
    for e in ops:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = {}
    for key, lst in by_tid.items():
        lst.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts = [e["ts"] for e in lst]
        mine = sorted((e for e in launches if (e.get("pid"), e.get("tid")) == key), key=lambda e: e["ts"])
        stack: list[dict] = []
        i = 0
        for ln in mine:
            t = ln["ts"]
            j = bisect.bisect_right(starts, t)
            while i < j:  # open every operator that started before this launch, closing finished ones
                e = lst[i]
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"]:
                    stack.pop()
                stack.append(e)
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            out[ln["args"]["correlation"]] = [e for e in stack if e["ts"] + e["dur"] >= t]
    return out


def _own_kernels(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the kernels launched inside the trace, those launched before it). A kernel is carried in when the
    trace records launches (runtime or driver calls with a correlation id) but none with the kernel's id."""
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    own, carried = [], []
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            c = e.get("args", {}).get("correlation")
            (carried if launched and c is not None and c not in launched else own).append(e)
    return own, carried


def gemm_families(events: list[dict], weights: dict) -> dict:
    """ms per "family/direction" (``lm_head/all`` for CODA's LM-head program, which runs all three),
    the GEMM kernels left unattributed, and the attention total, over the trace's kernels."""
    kernels = sorted(_own_kernels(events)[0], key=lambda e: e["ts"])  # (the step's own: as ``summarize_trace``)
    stacks = _launch_stacks(events)
    fams: dict[str, float] = {}
    unattributed = 0.0
    backward = False  # stock: the LM head's backward opens the backward
    mlp_since_attn = True  # stock: an MLP GEMM since the last attention kernel (or none yet)
    last_dir = None  # stock: the direction of the last GEMM attributed
    attention = 0.0
    programs = [e for e in events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("coda::norm_rope")]
    coda_step = bool(programs)
    tokens = _two_d(programs[0].get("args", {}).get("Input Dims"))[0][0] if coda_step else None  # F3's H: (T, d)
    for k in kernels:
        name = k["name"].lower()
        if "flash" in name or "fmha" in name:
            attention += k["dur"]
            mlp_since_attn = False
            continue
        stack = stacks.get(k.get("args", {}).get("correlation"), [])
        coda = next((e for e in stack if e["name"].startswith("coda::")  # the outermost program
                     and _program_base(e["name"][6:]) in CODA_PROGRAMS), None)
        if coda is not None:
            fd = _coda_family(coda["name"][6:], coda.get("args", {}).get("Input Dims"), weights)
        else:
            op = next((e for e in reversed(stack) if e["name"] in GEMM_OPS), None)
            fd = None
            if op is not None and coda_step:  # a GEMM traced into a compiled backward (``trace_passes``)
                dims = op.get("args", {}).get("Input Dims")
                a = (_two_d(dims) or [[None, None]])[0]
                cands = {c for c in gemm_matches(dims, weights) if c[0] in CODA_WEIGHTS
                         and (c[1] == "wgrad" and a[1] == tokens or c == ("wo", "dgrad") and a[0] == tokens)}
                fams_here = {(_FAMILY_OF[w], d) for w, d in cands}
                fd = next(iter(fams_here)) if len(fams_here) == 1 else None
            elif op is not None:
                cands = gemm_matches(op.get("args", {}).get("Input Dims"), weights)
                cands = {c for c in cands if c[0] not in ("qkv", "w13")}  # stock holds the separate weights
                if any(w == "lm_head" and d != "fwd" for w, d in cands):
                    backward = True
                forward = second_operand_transposed(op)
                cands = {c for c in cands if (c[1] == "fwd") == (not backward if forward is None else forward)} or cands
                fams_here = {(_FAMILY_OF[w], d) for w, d in cands}
                dirs = {d for _, d in fams_here}
                if dirs == {"fwd"} and last_dir not in (None, "fwd"):
                    mlp_since_attn = True  # a forward recomputed in the backward starts its layer, as the step does
                if len(dirs) == 1:
                    last_dir = next(iter(dirs))
                if {f for f, _ in fams_here} == {"qkv", "out"} and len(dirs) == 1:
                    # forward: q before its layer's attention, o after it; backward: o before, q after
                    fams_here = {("qkv" if mlp_since_attn == (last_dir == "fwd") else "out", last_dir)}
                if len(fams_here) == 1:
                    fd = next(iter(fams_here))
            if fd is None and op is not None:
                unattributed += k["dur"]
        if fd is not None:
            if fd[0] in ("w13", "w2"):
                mlp_since_attn = True
            key = f"{fd[0]}/{fd[1]}"
            fams[key] = fams.get(key, 0.0) + k["dur"]
    return {"families_ms": {k: round(v / 1e3, 3) for k, v in sorted(fams.items())},
            "unattributed_gemm_ms": round(unattributed / 1e3, 3), "attention_ms": round(attention / 1e3, 3)}


def trace_doc(trace_path: str) -> dict:
    """A chrome trace, from the profiler's JSON or its gzipped copy (``--keep-trace``)."""
    import gzip

    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        return json.load(f)


def trace_events(trace_path: str) -> list[dict]:
    """A chrome trace's events (``trace_doc``)."""
    return trace_doc(trace_path)["traceEvents"]
