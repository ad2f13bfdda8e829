"""GEMM-family attribution of a profiled step (scripts/compare/families.py), on synthetic torch-profiler
traces of a stock and a CODA step whose every kernel's family is known by construction."""

import pytest

from scripts.compare.families import gemm_families, gemm_matches

T, D, KV, FF, V = 64, 32, 8, 96, 50  # tokens, dim, kv width, FFN, vocab: W_q and W_o are both D x D
WEIGHTS = {"wq": (D, D), "wk": (KV, D), "wv": (KV, D), "wo": (D, D), "w1": (FF, D), "w3": (FF, D), "w2": (D, FF),
           "qkv": (D + 2 * KV, D), "w13": (2 * FF, D), "lm_head": (V, D)}


class Trace:
    """Builds chrome-trace events as the torch profiler writes them: host operators (nested, with
    Input Dims), a runtime launch per kernel, the kernel with the launch's correlation id."""

    def __init__(self):
        self.events, self.t, self.corr, self.expected = [], 0.0, 0, {}

    def op(self, name, dims, kernels, tid=1, parent="aten::linear", strides=None):
        """An operator (inside ``parent``) launching ``kernels``: (kernel name, family/direction or None);
        ``strides``: its Input Strides (recorded by the profiler with the shapes)."""
        t0 = self.t
        inner = []
        for kname, fam in kernels:
            self.corr += 1
            self.t += 1
            inner.append({"ph": "X", "cat": "cuda_runtime" if self.corr % 2 else "cuda_driver", "name": "cudaLaunchKernel",
                          "pid": 1, "tid": tid, "ts": self.t, "dur": 0.5, "args": {"correlation": self.corr}})
            dur = 10.0 + self.corr  # every kernel its own duration
            self.events.append({"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": 7, "ts": 1e6 + 100 * self.corr,
                                "dur": dur, "args": {"correlation": self.corr}})
            if fam:
                self.expected[fam] = self.expected.get(fam, 0.0) + dur
        self.t += 2
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": t0 + 0.5,
                            "dur": self.t - t0 - 1, "args": {"Input Dims": dims,
                                                             **({"Input Strides": strides} if strides else {})}})
        if parent:
            self.events.append({"ph": "X", "cat": "cpu_op", "name": parent, "pid": 1, "tid": tid, "ts": t0, "dur": self.t - t0,
                                "args": {"Input Dims": []}})
        self.t += 1
        self.events += inner

    def mm(self, weight, direction, fam, tid=1, op="aten::mm", strides=False):
        """A stock GEMM of ``weight``; ``strides``: with the Input Strides of its operands as autograd passes
        them (the forward's W^T a transposed view; the dgrad's W and the wgrad's input row-major)."""
        n, k = WEIGHTS[weight]
        dims = {"fwd": [[T, k], [k, n]], "dgrad": [[T, n], [n, k]], "wgrad": [[n, T], [T, k]]}[direction]
        st = {"fwd": [[k, 1], [1, k]], "dgrad": [[n, 1], [k, 1]], "wgrad": [[1, n], [k, 1]]}[direction]
        if op == "aten::addmm":
            dims, st = [[n], *dims], [[1], *st]
        self.op(op, dims, [("sm90_xmma_gemm_bf16bf16", f"{fam}/{direction}")], tid=tid, strides=st if strides else None)

    def attention(self, direction, tid=1):
        self.op(f"coda::flash_attn_{direction}", [[1, T, 4, 8]] * 3, [(f"flash_{direction}_sm90", None)], tid=tid, parent=None)

    def ms(self):
        return {k: round(v / 1e3, 3) for k, v in sorted(self.expected.items())}


def test_stock_step_is_attributed_by_shape_and_order():
    tr, layers = Trace(), 2
    for _ in range(layers):  # forward
        for w in ("wq", "wk", "wv"):
            tr.mm(w, "fwd", "qkv", op="aten::addmm" if w == "wk" else "aten::mm")
        tr.attention("fwd")
        tr.mm("wo", "fwd", "out")
        for w, f in (("w1", "w13"), ("w3", "w13"), ("w2", "w2")):
            tr.mm(w, "fwd", f)
    tr.mm("lm_head", "fwd", "lm_head")
    tr.op("aten::_log_softmax", [[T, V]], [("softmax_kernel", None)], parent=None)
    for d in ("dgrad", "wgrad"):  # backward, on the autograd thread
        tr.mm("lm_head", d, "lm_head", tid=2)
    for _ in range(layers):
        for w, f in (("w2", "w2"), ("w3", "w13"), ("w1", "w13"), ("wo", "out")):
            for d in ("dgrad", "wgrad"):
                tr.mm(w, d, f, tid=2)
        tr.attention("bwd", tid=2)
        for w in ("wv", "wk", "wq"):
            for d in ("dgrad", "wgrad"):
                tr.mm(w, d, "qkv", tid=2)
    got = gemm_families(tr.events, WEIGHTS)
    assert got["families_ms"] == tr.ms()
    assert got["unattributed_gemm_ms"] == 0 and got["attention_ms"] > 0
    # the shapes alone are ambiguous: W1's forward is W2's dgrad, W_q's GEMMs are W_o's
    assert gemm_matches([[T, D], [D, FF]], WEIGHTS) >= {("w1", "fwd"), ("w2", "dgrad")}
    assert gemm_matches([[T, D], [D, D]], WEIGHTS) >= {("wq", "fwd"), ("wo", "fwd"), ("wq", "dgrad")}


@pytest.mark.parametrize("strides", [True, False])
def test_stock_step_with_activation_checkpointing_is_attributed_by_strides(strides):
    """Under full activation checkpointing each layer's forward GEMMs run again inside the backward, after the
    LM head's backward: with the operands' strides recorded they stay forwards (a forward's second operand is
    the weight's transposed view), in the families the step ran them; without strides the order rule takes
    them for backward GEMMs of the same shapes (W1's forward for W2's dgrad), which these traces expose."""
    tr, layers = Trace(), 2
    qkv = (("wq", "qkv"), ("wk", "qkv"), ("wv", "qkv"))
    mlp = (("w1", "w13"), ("w3", "w13"), ("w2", "w2"))

    def forward(tid):
        for w, f in qkv:
            tr.mm(w, "fwd", f, tid=tid, strides=strides)
        tr.attention("fwd", tid=tid)
        tr.mm("wo", "fwd", "out", tid=tid, strides=strides)
        for w, f in mlp:
            tr.mm(w, "fwd", f, tid=tid, strides=strides, op="aten::addmm" if w == "w3" else "aten::mm")

    for _ in range(layers):
        forward(1)
    tr.mm("lm_head", "fwd", "lm_head", strides=strides)
    for d in ("dgrad", "wgrad"):
        tr.mm("lm_head", d, "lm_head", tid=2, strides=strides)
    for _ in range(layers):
        forward(2)  # the checkpointed layer's recompute
        for w, f in (("w2", "w2"), ("w3", "w13"), ("w1", "w13"), ("wo", "out")):
            for d in ("dgrad", "wgrad"):
                tr.mm(w, d, f, tid=2, strides=strides)
        tr.attention("bwd", tid=2)
        for w, f in reversed(qkv):
            for d in ("dgrad", "wgrad"):
                tr.mm(w, d, f, tid=2, strides=strides)
    got = gemm_families(tr.events, WEIGHTS)
    assert (got["families_ms"] == tr.ms()) == strides, got["families_ms"]
    assert got["unattributed_gemm_ms"] == 0 or not strides


@pytest.mark.parametrize("fp8", [False, True, "sites", "down_dgrad"])
def test_coda_step_is_attributed_by_program(fp8):
    """(fp8 "sites": the programs of the current fp8 defaults, whose names carry more than ``_fp8``:
    F1 on fp8 (``residual_rms_q[_fp8]``), F2 writing e4m3 y, B3 writing e5m2 da and da^T only, dW13
    on it; "down_dgrad": that B3 on an fp8 GEMM)"""
    s = "_fp8" if fp8 else ""
    b3 = {"sites": "swiglu_bwd_e5m2_t", "down_dgrad": "swiglu_bwd_e5m2_t_q"}.get(fp8, f"swiglu_bwd{s}")
    fp8 = "sites" if fp8 == "down_dgrad" else fp8
    f1, f2 = ("residual_rms_q_fp8", "norm_swiglu_q_fp8") if fp8 == "sites" else (f"residual_rms{s}", f"norm_swiglu{s}")
    tr = Trace()
    quack = "kernel_cutlass_kernel_quackepiloguefrontendGemmMod_x"
    triton = "triton_poi_fused_rope_bwd_0"

    def prog(name, dims, fam, extra=(), tid=1):
        tr.op(f"coda::{name}", dims, [(quack, fam), *((k, fam) for k in extra)], tid=tid, parent="CompiledFunction")

    prog(f"rms_partial{s}", [[T, D], [D]], None)
    for _ in range(2):
        prog(f"norm_rope{s}", [[T, D], [T, 1], [D + 2 * KV, D]], "qkv/fwd")
        tr.attention("fwd")
        prog(f1, [[T, D], [D, D], [T, D], [D], []], "out/fwd")
        prog(f2, [[T, D], [T, 1], [2 * FF, D]], "w13/fwd")
        prog(f1.removesuffix("_fp8") if fp8 == "sites" else f1, [[T, FF], [D, FF], [T, D], [D], []], "w2/fwd")
    tr.op("coda::lm_head_ce", [[T, D], [T, 1], [T, D], [D], [V, D], [T]],
          [(quack, "lm_head/all"), ("triton_red_fused_ce_grad", "lm_head/all"), ("sm90_xmma_gemm", "lm_head/all")],
          parent="LMHeadCE")
    for _ in range(2):
        prog(b3, [[T, D], [D, FF], [T, 2 * FF], [T, 1]], "w2/dgrad", tid=2)
        prog(f"norm_residual_bwd{s}", [[T, 2 * FF], [2 * FF, D], [T, D], [D], [T, 1], [T, 1], [T, D]], "w13/dgrad", tid=2)
        tr.op("coda::wgrad", [[T, D], [T, FF], []], [("sm90_xmma_gemm", "w2/wgrad")], tid=2)
        if fp8 == "sites":
            tr.op("coda::wgrad_fp8_e5m2", [[T, 2 * FF], [], [T, D], [], []], [("transpose", "w13/wgrad"),
                                                                                ("sm90_xmma_gemm_e5m2", "w13/wgrad")], tid=2)
        elif fp8:
            tr.op("coda::wgrad_fp8", [[T, 2 * FF], [], [T, D], [], []], [("cast_transpose", "w13/wgrad"),
                                                                           ("sm90_xmma_gemm_e5m2", "w13/wgrad")], tid=2)
        else:
            tr.op("coda::wgrad", [[T, 2 * FF], [T, D], []], [("sm90_xmma_gemm", "w13/wgrad")], tid=2)
        tr.op("coda::dgrad", [[T, D], [D, D], []], [("sm90_xmma_gemm", "out/dgrad")], tid=2)
        tr.op("coda::wgrad", [[T, D], [T, D], []], [("sm90_xmma_gemm", "out/wgrad")], tid=2)
        tr.attention("bwd", tid=2)
        tr.op(f"coda::rope_bwd{s}", [[T, D + 2 * KV]], [(triton, None)], tid=2)
        prog(f"norm_residual_bwd{s}", [[T, D + 2 * KV], [D + 2 * KV, D], [T, D], [D], [T, 1], [T, 1], [T, D]],
             "qkv/dgrad", tid=2)
        tr.op("coda::wgrad", [[T, D + 2 * KV], [T, D], []], [("sm90_xmma_gemm", "qkv/wgrad")], tid=2)
    got = gemm_families(tr.events, WEIGHTS)
    assert got["families_ms"] == tr.ms() and got["unattributed_gemm_ms"] == 0
    assert set(got["families_ms"]) == {f"{f}/{d}" for f in ("qkv", "out", "w13", "w2") for d in ("fwd", "dgrad", "wgrad")} | {"lm_head/all"}


def test_coda_gemms_traced_into_the_compiled_backward_are_attributed_by_shape():
    """``trace_passes``: the plain weight / input gradients are ``aten::mm`` / ``_scaled_mm`` inside the
    compiled backward, not programs. With tokens = the rows of W13 (T = 2 FF, as at 1B: 16384) W13's
    wgrad also fits a W13 dgrad by shape; CODA's only plain dgrad is W_o's."""
    t, ff = 2 * FF, FF
    weights = {**WEIGHTS, "w1": (ff, D), "w3": (ff, D), "w2": (D, ff), "w13": (t, D)}
    tr = Trace()
    tr.op("coda::norm_rope", [[t, D], [t, 1], [D + 2 * KV, D]],
          [("kernel_cutlass_kernel_quackepiloguefrontendGemmMod_x", "qkv/fwd")], parent="CompiledFunction")
    for op, dims, fam in (("aten::mm", [[D, t], [t, ff], [D, ff]], "w2/wgrad"),
                          ("aten::_scaled_mm", [[t, t], [t, D], [], [], [], [], [], [], [t, D]], "w13/wgrad"),
                          ("aten::mm", [[t, D], [D, D], [t, D]], "out/dgrad"),
                          ("aten::mm", [[D, t], [t, D], [D, D]], "out/wgrad"),
                          ("aten::_scaled_mm", [[D + 2 * KV, t], [t, D], [], [], [D + 2 * KV, D]], "qkv/wgrad")):
        tr.op(op, dims, [("nvjet_sm90_tst_256x128", fam)], tid=2, parent="CompiledFunctionBackward")
    got = gemm_families(tr.events, weights)
    assert got["families_ms"] == tr.ms() and got["unattributed_gemm_ms"] == 0
