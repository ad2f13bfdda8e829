"""Run by tests/test_lm_head_ce.py in a subprocess with TRITON_INTERPRET=1: the CUDA LM head's program
(``kernels/cute/lm_head_ce._lm_head_ce``, taken from its source) on CPU tensors, its GEMMs stood in for by torch
(F4: the logits of the e4m3 codes rounded to bf16, their per-tile log-sum-exps and target logit; B2's accumulator:
each row's fp64 product; dW's fp8 GEMM: the codes' fp64 product, stored bf16), its Triton passes through the
interpreter. Checked against the same stand-ins and passes run chunk by chunk with no buffer shared between
chunks: the program's orchestration (the logits buffer reused by chunks, the chunk offsets of loss, dX and the
codes' counters, the codes' columns in the token-major buffer) changes no bit. ``fp8_lm_head_dw``, by the row
pass then ``transpose_8bit`` and by ``ce_codes_t`` (CODA_TITAN_CE_CODES_T=1); ``fp8_lm_head_dgrad``, by the codes-only
pass (into one buffer kept across chunks) and B2 on them, each target's zeroed after dW's copy, plus the targets' exact
term in the row pass (cuBLAS's fp8 GEMM stood in for by each row's fp64 product). Prints one JSON line."""

import contextlib
import json
import os
import types

import torch
from interpreter_stub import cute_function, cute_module

from coda_titan.kernels import lm_head_ce as ref
from coda_titan.kernels import scaling
from coda_titan.kernels.gemm import quantize_tensorwise

ce_pass, codes_t, tr8, nap = (cute_module(n) for n in ("ce_grad_pass", "ce_codes_t", "transpose_8bit",
                                                       "norm_apply_pass"))
TILE = 512  # (F4's N tile: the log-sum-exp partials a row)


def f4(epi, a, b_kn, c, out, rstd, target):
    """F4's stand-in: D = bf16(rstd (A B)), the per-tile log-sum-exps of D and its target logit."""
    logits = ((a.double() @ b_kn.double()) * rstd.double()[:, None]).to(torch.bfloat16)
    out["D"].copy_(logits)
    lf = logits.float()
    parts = torch.stack([torch.logsumexp(lf[:, s:s + TILE], -1) for s in range(0, lf.shape[1], TILE)], -1)
    return {"lse": parts, "target_logit": lf.gather(1, target.clamp(min=0)[:, None]).squeeze(1)}


def mm_rows(a, b, out_dtype):
    """B2's accumulator stand-in: each row's product in fp64, rounded once (the same bits whatever the chunk)."""
    return torch.stack([(a[i].double() @ b.double()).to(out_dtype) for i in range(a.shape[0])])


def codes_product(daq_t, hq, inv_g, s_h, dtype):
    """dW's fp8 GEMM stand-in: the codes' fp64 product over every token, scaled, stored in ``dtype``."""
    return ((daq_t.double() @ hq.double()) * (s_h.double() / inv_g.double())).to(dtype)


def fp8_dw(daq_t, hq, inv_g, s_h, dtype):
    captured["daq_t"] = daq_t.clone()
    return codes_product(daq_t, hq, inv_g, s_h, dtype)


def product(a, b, alpha):
    return (a.contiguous().double() @ b.contiguous().double()) * alpha.double()


def quack_gemm(a, b, out_dtype, alpha, tuned):
    """quack's GEMM stand-in (a token block's dW, ``CODA_TITAN_DW_BLOCKS``): alpha (A B) in fp64, stored once."""
    return product(a, b, alpha).to(out_dtype)


def gemm_add_inplace(a, b, out, alpha, tuned):
    out.copy_((out.double() + product(a, b, alpha)).to(out.dtype))


def dw_chunk(da, hc, dw, dtype, *, first: bool, last: bool):
    """The bf16 dW's stand-in (quack's GEMMs): an fp64 sum over chunks, stored in ``dtype`` by the last."""
    part = da.double().t() @ hc.double()
    dw = part if first else dw + part
    return dw.to(dtype) if last else dw


class TorchWithMm(types.SimpleNamespace):
    """torch, but ``mm(..., out_dtype=)`` by rows (aten's dtype mm has no CPU kernel)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def mm(a, b, out_dtype=None):
        return mm_rows(a, b, out_dtype or a.dtype)

    @staticmethod
    def _scaled_mm(a, b, scale_a, scale_b, out_dtype):
        """cuBLAS's fp8 GEMM stand-in (``fp8_lm_head_dgrad``'s B2): each row's product of the codes in fp64, scaled."""
        return scaled_rows(a, b, scale_a, scale_b, out_dtype)


def scaled_rows(a, b, scale_a, scale_b, out_dtype):
    return (mm_rows(a, b, torch.float64) * (scale_a.double() * scale_b.double())).to(out_dtype)


captured = {}
ns = {"torch": TorchWithMm(), "os": os, "ref": ref, "E5M2": scaling.E5M2, "sr_seed_of": scaling.sr_seed_of,
      "CE_PASS_ENV": ref.CE_PASS_ENV, "unsupported": lambda *t: None, "unsupported_fp8": lambda *t: None,
      "f4_epilogue": lambda dtype: "f4", "fused": lambda name, fn: fn, "_ce_grad_math": None, "b2_epilogue": lambda last: ("b2", None),
      "first_call": lambda *a: contextlib.nullcontext(), "gemm": f4, "norm_apply_rows": nap.norm_apply_rows,
      "ce_grad_inplace": ce_pass.ce_grad_inplace, "ce_grad_e5m2": ce_pass.ce_grad_e5m2, "ce_codes_t": codes_t,
      "transpose_8bit": tr8,
      "_fp8_dw": fp8_dw, "_dw_chunk": dw_chunk, "stages": None, "quack_gemm": quack_gemm,
      "gemm_add_inplace": gemm_add_inplace, "TUNE": False, "DW_BLOCKS_ENV": "CODA_TITAN_DW_BLOCKS"}
program = cute_function("lm_head_ce.py", "def _lm_head_ce", "def _refuse_probe_arms", ns)
ns["_refuse_probe_arms"] = lambda: None

torch.manual_seed(0)
m, d, vocab, chunk = 40, 64, 1500, 16  # (three chunks, the last ragged)
x, gamma = torch.randn(m, d).bfloat16(), torch.rand(d) + 0.5
rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
h = (x.float() * rstd[:, None] * gamma).bfloat16()
w = (torch.randn(vocab, d) * 0.5).bfloat16()
(hq, s_h), (wq, s_w) = quantize_tensorwise(w=h), quantize_tensorwise(w=w)
targets = torch.randint(0, vocab, (m,))
targets[5] = ref.IGNORE_INDEX


def by_chunks(fp8_dw_on: bool, dgrad: bool = False):
    """The same stand-ins and passes, chunk by chunk, each chunk with buffers of its own (``dgrad``: the codes alone,
    B2's accumulator their product with W's codes, each target's code zeroed, and the row pass adding da_t W[t])."""
    loss_rows, dx, dgamma = torch.empty(m), torch.empty_like(x), torch.zeros(d)
    daq_t = torch.empty((vocab, m), dtype=scaling.E5M2)
    inv_g = ref.dlogits_inv_scale(rstd, targets).float().reshape(())
    seed = scaling.sr_seed_of(targets)
    for start in range(0, m, chunk):
        rows = slice(start, min(start + chunk, m))
        logits = torch.empty((rows.stop - start, vocab), dtype=torch.bfloat16)
        res = f4(None, hq[rows], wq.t(), None, {"D": logits}, rstd[rows] * (s_h * s_w).reshape(()), targets[rows])
        tx = None
        if dgrad:  # (B2 on the codes with each target's zeroed, dW's keeping it, plus the targets' da_t W[t])
            codes, da_t = ce_pass.ce_grad_e5m2(logits, res["lse"], res["target_logit"], targets[rows], rstd[rows],
                                               inv_g, ref.IGNORE_INDEX, loss_rows[rows], sr_seed=seed, row0=start,
                                               target_da=True)
            daq, ti = [codes.clone()], targets[rows].clamp(min=0)
            codes.view(torch.uint8)[torch.arange(len(ti)), ti] = 0
            acc, tx = scaled_rows(codes, wq, inv_g.reciprocal(), s_w.float(), torch.float32), (w, ti, da_t)
        else:
            kw = dict(codes_inv=inv_g, sr_seed=seed, row0=start) if fp8_dw_on else {}
            da, corr, *daq = ce_pass.ce_grad_inplace(logits, res["lse"], res["target_logit"], targets[rows],
                                                     rstd[rows], ref.IGNORE_INDEX, d, loss_rows[rows], **kw)
            acc = mm_rows(da, w, torch.float32)
        dgamma += nap.norm_apply_rows(acc, x[rows], gamma, rstd[rows], dx[rows], tx=tx)
        if fp8_dw_on:
            daq_t[:, rows] = daq[0].t()
    return loss_rows.sum(), dx, dgamma, daq_t


got = {}
want = by_chunks(True)
inv_g = ref.dlogits_inv_scale(rstd, targets).float().reshape(())
for arm in ("row_pass", "codes_t"):  # (codes_t: its row sums in another order, so loss, dX, dgamma not its bits)
    os.environ[codes_t.ENV] = "1" if arm == "codes_t" else "0"
    captured.clear()
    loss, dx, dgamma, dw = program(h, rstd, x, gamma, w, targets, chunk, True, hq, s_h, wq, s_w, True)
    q, qw = captured["daq_t"].float(), want[3].float()
    step = 2.0 ** (torch.floor(torch.log2(qw.abs().clamp(min=2.0 ** -14))) - 2)
    got[arm] = {"loss_same": bool(torch.equal(loss, want[0])), "dx_same": bool(torch.equal(dx, want[1])),
                "dgamma_same": bool(torch.equal(dgamma, want[2])),
                "codes_equal_share": float((q == qw).double().mean()),
                "codes_within_step": bool(((q - qw).abs() <= step * (1 + 1e-6)).all()),
                "dw_is_its_codes_product": bool(torch.equal(dw, codes_product(captured["daq_t"], hq, inv_g, s_h,
                                                                                w.dtype)))}
os.environ.pop(codes_t.ENV)
# fp8_lm_head_dgrad: the codes alone (the same codes), B2 on them and W's codes
captured.clear()
loss, dx, dgamma, dw = program(h, rstd, x, gamma, w, targets, chunk, True, hq, s_h, wq, s_w, True, True)
want_dg = by_chunks(True, dgrad=True)
got["dgrad"] = {"loss_same": bool(torch.equal(loss, want_dg[0])), "dx_same": bool(torch.equal(dx, want_dg[1])),
                "dgamma_same": bool(torch.equal(dgamma, want_dg[2])),
                "codes_same": bool(torch.equal(captured["daq_t"].view(torch.uint8), want[3].view(torch.uint8))),
                "dw_is_its_codes_product": bool(torch.equal(dw, codes_product(want[3], hq, inv_g, s_h, w.dtype))),
                "dx_moved": bool(not torch.equal(dx, want[1]))}
# dW over token blocks (CODA_TITAN_DW_BLOCKS=k; whole chunks a block, the last ragged): the first block's product
# stored in W's dtype, each next one added to it and stored again, from the chunks' own codes
alpha = (s_h.float() / inv_g).reshape(1)
for k, width in ((2, 32), (3, 16)):
    os.environ["CODA_TITAN_DW_BLOCKS"] = str(k)
    loss, dx, dgamma, dw = program(h, rstd, x, gamma, w, targets, chunk, True, hq, s_h, wq, s_w, True)
    expect = None
    for b0 in range(0, m, width):
        part = product(want[3][:, b0:b0 + width], hq[b0:b0 + width], alpha)
        expect = (part if expect is None else expect.double() + part).to(w.dtype)
    got[f"blocks_{k}"] = {"loss_same": bool(torch.equal(loss, want[0])), "dx_same": bool(torch.equal(dx, want[1])),
                          "dgamma_same": bool(torch.equal(dgamma, want[2])), "dw_same": bool(torch.equal(dw, expect)),
                          "dw_moved": bool(not torch.equal(dw, codes_product(want[3], hq, inv_g, s_h, w.dtype)))}
os.environ.pop("CODA_TITAN_DW_BLOCKS")
plain = program(h, rstd, x, gamma, w, targets, chunk, True, hq, s_h, wq, s_w, False)
want0 = by_chunks(False)
got["no_dw"] = {"loss_same": bool(torch.equal(plain[0], want0[0])), "dx_same": bool(torch.equal(plain[1], want0[1])),
                "dgamma_same": bool(torch.equal(plain[2], want0[2]))}
print(json.dumps(got))
