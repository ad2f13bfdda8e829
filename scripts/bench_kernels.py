"""Benchmark (GPU): each fused CODA program against its bare GEMM, eager torch, torch.compile, Liger.

    source .gpu/part2/activate.sh && python3 -m scripts.bench_kernels --dims 2048 4096 8192

For every program and d it times (median of triton's do_bench, after a warm-up call that compiles
and autotunes):

* ``coda``: the cute kernel through ``torch.ops.coda`` (autotuned unless CODA_TITAN_AUTOTUNE=0);
* ``bare_gemm``: torch.mm of the same GEMM shape (the sum over GEMMs for multi-GEMM programs);
* ``eager``: the unfused computation stock TorchTitan runs for the same work, in torch;
* ``torch_compile``: that unfused computation under inductor (``torch.compile``, static shapes);
* ``liger``: Liger-Kernel's op where it has one and is installed, else null (``liger_note`` says).

Inputs are random (never zeros). For the chunked LM head + CE the peak allocated memory of the
coda program and of the full-logits eager path are recorded too. Writes
``$OUT/kernels_<gpu>_d<d>.json`` per d (``scripts/report.py`` merges them into
``benchmarks/results/kernels_<gpu>.json``, the plot and the README table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import time

import torch
import torch.nn.functional as F

M = 16384
VOCAB = 128256
# LLaMA-3 shapes at each hidden size: (ffn hidden, q heads, kv heads, head_dim)
SHAPES = {2048: (8192, 32, 8, 64), 4096: (14336, 32, 8, 128), 8192: (28672, 64, 8, 128)}
EPS = 1e-5


def header() -> dict:
    """device, date and versions: the first keys of every kernel result file."""
    import quack

    return {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "quack": getattr(quack, "__version__", "?"), "cuda": torch.version.cuda},
    }


def _bench(fn, reps=None):
    from triton.testing import do_bench

    fn()  # compile / autotune / allocate outside the timed region
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200 if reps is None else reps, return_mode="median")


def _try(fn):
    try:
        return _bench(fn)
    except Exception as e:  # noqa: BLE001 - record why a baseline could not run
        print(f"  baseline failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _liger():
    try:
        import liger_kernel  # noqa: F401

        return True
    except ImportError:
        return False


def _rms_bwd_unfused(g, x, gamma, r):
    """Stock RMSNorm backward given g = d(normalized output) (what autograd of rms_norm computes)."""
    xf, gf = x.float(), g.float()
    gg = gf * gamma.float()
    dot = (gg * xf).sum(-1, keepdim=True)
    dx = r[:, None] * gg - (r[:, None] ** 3 / x.shape[1]) * xf * dot
    dgamma = (gf * xf * r[:, None]).sum(0)
    return dx, dgamma


def cases(d, gen):
    """(op, direction, callables builder) for hidden size d."""
    from coda_titan.kernels import get_backend
    from coda_titan.kernels._common import interleave_rows
    from coda_titan.model.rope import rope_freqs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.models.llama3.model.model import apply_rotary_emb, precompute_freqs_cis

    be = get_backend("cute")
    ff, hq, hkv, hd = SHAPES[d]
    q = (hq + 2 * hkv) * hd
    bf = torch.bfloat16
    seqlen = 8192

    def r(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    rstd = torch.rand(M, generator=gen, device="cuda") + 0.5
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(bf)
    out = []

    # F1: out-projection + residual + partial RMS  (stock: linear, add, rms_norm)
    y, wo, res = r(M, hq * hd), r(d, hq * hd, scale=(hq * hd) ** -0.5), r(M, d)

    def f1_eager(y=y, wo=wo, res=res):
        x = res + F.linear(y, wo)
        return x, F.rms_norm(x, (d,), gamma, EPS)

    out.append(("residual_rms", "fwd", dict(
        coda=lambda: be.residual_rms(y=y, weight=wo, residual=res, gamma=gamma, tile_n=128),
        bare_gemm=[lambda: torch.mm(y, wo.t())], eager=f1_eager)))

    # F2: W13 GEMM + deferred rstd + SwiGLU  (stock: two linears on the normalized input, silu * up)
    h = r(M, d)
    w1, w3 = r(ff, d, scale=d**-0.5), r(ff, d, scale=d**-0.5)
    w13 = interleave_rows(w1, w3)

    def f2_eager(h=h):
        n = F.rms_norm(h, (d,), None, EPS)
        return F.silu(F.linear(n, w1)) * F.linear(n, w3)

    out.append(("norm_swiglu", "fwd", dict(
        coda=lambda: be.norm_swiglu(h=h, rstd=rstd, w13=w13),
        bare_gemm=[lambda: torch.mm(h, w13.t())], eager=f2_eager)))

    # F3: QKV GEMM + deferred rstd + RoPE  (stock: rms_norm, three linears, apply_rotary_emb)
    wqkv = r(q, d, scale=d**-0.5)
    wq, wk, wv = wqkv.split([hq * hd, hkv * hd, hkv * hd])
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    freqs_cis = precompute_freqs_cis(hd, seqlen, 500000.0, RoPEScalingArgs()).cuda()
    bs = M // seqlen

    def f3_eager(h=h):
        n = F.rms_norm(h, (d,), None, EPS)
        xq = F.linear(n, wq).view(bs, seqlen, hq, hd)
        xk = F.linear(n, wk).view(bs, seqlen, hkv, hd)
        xv = F.linear(n, wv)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        return xq, xk, xv

    out.append(("norm_rope", "fwd", dict(
        coda=lambda: be.norm_rope(h=h, rstd=rstd, weight=wqkv, freqs=freqs, seqlen=seqlen,
                                  n_rope_heads=hq + hkv, head_dim=hd),
        bare_gemm=[lambda: torch.mm(h, wqkv.t())], eager=f3_eager)))

    # B1: RoPE backward + zdz  (stock: autograd's inverse rotation of dq, dk)
    dqkv, qkv = r(M, q), r(M, q)
    fc_conj = freqs_cis.conj()

    def b1_eager(dqkv=dqkv):
        dq = dqkv[:, : hq * hd].reshape(bs, seqlen, hq, hd)
        dk = dqkv[:, hq * hd: (hq + hkv) * hd].reshape(bs, seqlen, hkv, hd)
        return apply_rotary_emb(dq, dk, fc_conj)

    out.append(("rope_bwd", "bwd", dict(
        coda=lambda: be.rope_bwd(dy=dqkv, y=qkv, rstd=rstd, freqs=freqs, seqlen=seqlen,
                                 n_rope_heads=hq + hkv, head_dim=hd),
        bare_gemm=[], eager=b1_eager)))

    # B2: dgrad GEMM + RMSNorm/residual backward + dgamma (the QKV consumer's)
    da, x, zdz, dres = r(M, q), r(M, d), r(M, dtype=torch.float32), r(M, d)

    def b2_eager(da=da, x=x, dres=dres):
        g = torch.mm(da, wqkv)
        dx, dgamma = _rms_bwd_unfused(g, x, gamma, rstd)
        return (dx + dres.float()).to(bf), dgamma

    out.append(("norm_residual_bwd", "bwd", dict(
        coda=lambda: be.norm_residual_bwd(da=da, weight=wqkv, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dres),
        bare_gemm=[lambda: torch.mm(da, wqkv)], eager=b2_eager)))

    # B3: down-projection dgrad + SwiGLU backward + zdz  (stock: dgrad GEMM, silu/mul backward)
    w2 = r(d, ff, scale=ff**-0.5)
    dout, a = r(M, d), r(M, 2 * ff)
    g_pre, u_pre = a[:, 0::2].contiguous(), a[:, 1::2].contiguous()

    def b3_eager(dout=dout):
        dy = torch.mm(dout, w2).float()
        g, u = g_pre.float(), u_pre.float()
        s = torch.sigmoid(g)
        du = dy * g * s
        dg = dy * u * s * (1 + g * (1 - s))
        return dg.to(bf), du.to(bf), (g * s * u).to(bf)

    out.append(("swiglu_bwd", "bwd", dict(
        coda=lambda: be.swiglu_bwd(dout=dout, w_down=w2, a=a, rstd=rstd),
        bare_gemm=[lambda: torch.mm(dout, w2)], eager=b3_eager)))

    # F4: chunked LM head + CE with its gradients (stock: rms_norm, full logits, CE, autograd)
    xf = r(M, d)
    wout = r(VOCAB, d, scale=d**-0.5)
    tgt = torch.randint(0, VOCAB, (M,), generator=gen, device="cuda")
    hf = (xf.float() * gamma.float()).to(bf)
    rf = torch.rsqrt(xf.float().pow(2).mean(-1) + EPS)

    def f4_eager(xf=xf):
        x_ = xf.detach().requires_grad_()
        g_ = gamma.detach().requires_grad_()
        w_ = wout.detach().requires_grad_()
        logits = F.linear(F.rms_norm(x_, (d,), g_, EPS), w_)
        loss = F.cross_entropy(logits.float(), tgt, reduction="sum")
        loss.backward()
        return loss

    logits_buf = torch.empty(M, VOCAB, device="cuda", dtype=bf)
    dl = torch.empty(M, VOCAB, device="cuda", dtype=bf)
    out.append(("lm_head_ce", "fwd", dict(
        coda=lambda: be.lm_head_ce(h=hf, rstd=rf, x=xf, gamma=gamma, weight=wout, targets=tgt,
                                   chunk_rows=2048, compute_grad=True),
        bare_gemm=[lambda: torch.mm(hf, wout.t(), out=logits_buf), lambda: torch.mm(dl, wout),
                   lambda: torch.mm(dl.t(), hf)],
        eager=f4_eager, liger_kind="flce", liger_args=(hf, wout, tgt))))
    return out


def _float8_linears(*weights):
    """torchao float8 (tensorwise) linears holding ``weights``: the FP8 baseline's own layers."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mods = nn.ModuleList()
    for w in weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
        lin.weight.data.copy_(w)
        mods.append(lin)
    convert_to_float8_training(mods, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return list(mods)


def fp8_cases(d, gen):
    """precision = "fp8" programs: the coda fp8 program, the same GEMM as one cuBLAS fp8 _scaled_mm
    (bare_gemm), stock's computation with torchao float8 tensorwise linears (eager / torch_compile),
    and the bf16 coda program (coda_bf16)."""
    from coda_titan.kernels import get_backend
    from coda_titan.kernels._common import interleave_rows
    from coda_titan.kernels.scaling import E4M3, inv_scale_from_amax, quantize_e4m3
    from coda_titan.model.rope import rope_freqs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.models.llama3.model.model import apply_rotary_emb, precompute_freqs_cis

    be = get_backend("cute")
    ff, hq, hkv, hd = SHAPES[d]
    q = (hq + 2 * hkv) * hd
    bf = torch.bfloat16
    seqlen = 8192
    bs = M // seqlen

    def r(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    rstd = torch.rand(M, generator=gen, device="cuda") + 0.5
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(bf)
    h = r(M, d)
    inv_h = inv_scale_from_amax(h.float().abs().amax())
    h8 = quantize_e4m3(h.float(), inv_h)
    one = torch.ones((), device="cuda")
    out = []

    def scaled_mm(a8, w8):
        return lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=bf, use_fast_accum=True)

    # F1 producing e4m3 H (bf16 GEMM; its A operand is the attention / SwiGLU output)
    y, wo, res = r(M, hq * hd), r(d, hq * hd, scale=(hq * hd) ** -0.5), r(M, d)
    f8_wo = _float8_linears(wo)[0]

    def f1_eager(y=y, res=res):
        x = res + f8_wo(y)
        return x, F.rms_norm(x, (d,), gamma, EPS)

    out.append(("residual_rms_fp8", "fwd", dict(
        coda=lambda: be.residual_rms_fp8(y=y, weight=wo, residual=res, gamma=gamma, tile_n=128, inv_scale=inv_h),
        coda_bf16=lambda: be.residual_rms(y=y, weight=wo, residual=res, gamma=gamma, tile_n=128),
        bare_gemm=[lambda: torch.mm(y, wo.t())], eager=f1_eager)))

    # F2 on e4m3 operands
    w1, w3 = r(ff, d, scale=d**-0.5), r(ff, d, scale=d**-0.5)
    w13 = interleave_rows(w1, w3)
    w13q, s_w13 = be.quantize_tensorwise(w=w13)
    f8_w1, f8_w3 = _float8_linears(w1, w3)

    def f2_eager(h=h):
        n = F.rms_norm(h, (d,), None, EPS)
        return F.silu(f8_w1(n)) * f8_w3(n)

    out.append(("norm_swiglu_fp8", "fwd", dict(
        coda=lambda: be.norm_swiglu_fp8(hq=h8, rstd=rstd, w13q=w13q, scale=s_w13 / inv_h, out_dtype=bf),
        coda_bf16=lambda: be.norm_swiglu(h=h, rstd=rstd, w13=w13),
        bare_gemm=[scaled_mm(h8, w13q)], eager=f2_eager)))

    # F3 on e4m3 operands
    wqkv = r(q, d, scale=d**-0.5)
    wq, wk, wv = wqkv.split([hq * hd, hkv * hd, hkv * hd])
    wqkv8, s_qkv = be.quantize_tensorwise(w=wqkv)
    f8_wq, f8_wk, f8_wv = _float8_linears(wq, wk, wv)
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    freqs_cis = precompute_freqs_cis(hd, seqlen, 500000.0, RoPEScalingArgs()).cuda()

    def f3_eager(h=h):
        n = F.rms_norm(h, (d,), None, EPS)
        xq = f8_wq(n).view(bs, seqlen, hq, hd)
        xk = f8_wk(n).view(bs, seqlen, hkv, hd)
        xv = f8_wv(n)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        return xq, xk, xv

    out.append(("norm_rope_fp8", "fwd", dict(
        coda=lambda: be.norm_rope_fp8(hq=h8, rstd=rstd, weight_q=wqkv8, scale=s_qkv / inv_h, freqs=freqs,
                                      seqlen=seqlen, n_rope_heads=hq + hkv, head_dim=hd, out_dtype=bf),
        coda_bf16=lambda: be.norm_rope(h=h, rstd=rstd, weight=wqkv, freqs=freqs, seqlen=seqlen,
                                       n_rope_heads=hq + hkv, head_dim=hd),
        bare_gemm=[scaled_mm(h8, wqkv8)], eager=f3_eager)))

    # B1 with its e5m2 copy of da (current scale), then F3's dgrad B2 on e5m2 da x e4m3 W_qkv^T
    from coda_titan.kernels.gemm import wgrad_fp8_operands
    from coda_titan.kernels.scaling import E5M2_MAX, quantize_e5m2

    dqkv, qkv = r(M, q, scale=1e-3), r(M, q)
    b1 = dict(dy=dqkv, y=qkv, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=hq + hkv, head_dim=hd)
    out.append(("rope_bwd_fp8", "bwd", dict(
        coda=lambda: be.rope_bwd_fp8(**b1), coda_bf16=lambda: be.rope_bwd(**b1), bare_gemm=[],
        eager=lambda: quantize_e5m2(dqkv.float(), inv_scale_from_amax(dqkv.float().abs().amax(), E5M2_MAX)))))
    da, zdz, daq, s_da = be.rope_bwd_fp8(**b1)
    wqkv8_t = wqkv8.t().contiguous()
    x, dres = r(M, d), r(M, d)

    def b2_eager(dq, w8_t, s_g, s_w):
        """Stock's B2 on fp8: one _scaled_mm (e5m2 x e4m3), then the unfused norm backward."""
        def run():
            g = torch._scaled_mm(dq, w8_t.t(), scale_a=s_g.float(), scale_b=s_w.float(), out_dtype=bf)
            dx, dgamma = _rms_bwd_unfused(g, x, gamma, rstd)
            return (dx + dres.float()).to(bf), dgamma
        return run

    out.append(("norm_residual_bwd_fp8", "bwd", dict(
        coda=lambda: be.norm_residual_bwd_fp8(daq=daq, weight_tq=wqkv8_t, scale=s_da * s_qkv, x=x, gamma=gamma,
                                              rstd=rstd, zdz=zdz, dresidual=dres),
        coda_bf16=lambda: be.norm_residual_bwd(da=da, weight=wqkv, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dres),
        bare_gemm=[scaled_mm(daq, wqkv8_t)], eager=b2_eager(daq, wqkv8_t, s_da, s_qkv))))

    # fp8_mlp_dgrad: B3 also writing e5m2 da (delayed scale), then the MLP's dgrad B2 on e5m2 da x e4m3 W13^T
    w2 = r(d, ff, scale=ff**-0.5)
    dout, a = r(M, d, scale=1e-2), r(M, 2 * ff)
    da13, _, zdz13 = be.swiglu_bwd(dout=dout, w_down=w2, a=a, rstd=rstd)
    inv_g = inv_scale_from_amax(da13.float().abs().amax(), E5M2_MAX)
    b3 = dict(dout=dout, w_down=w2, a=a, rstd=rstd)
    out.append(("swiglu_bwd_fp8", "bwd", dict(
        coda=lambda: be.swiglu_bwd_fp8(**b3, inv_scale=inv_g), coda_bf16=lambda: be.swiglu_bwd(**b3),
        bare_gemm=[lambda: torch.mm(dout, w2)],
        eager=lambda: quantize_e5m2(da13.float(), inv_scale_from_amax(da13.float().abs().amax(), E5M2_MAX)))))
    daq13 = be.swiglu_bwd_fp8(**b3, inv_scale=inv_g)[3]
    w13q_t = w13q.t().contiguous()
    s_g = inv_g.reciprocal()

    out.append(("norm_residual_bwd_fp8_w13", "bwd", dict(
        coda=lambda: be.norm_residual_bwd_fp8(daq=daq13, weight_tq=w13q_t, scale=s_g * s_w13, x=x, gamma=gamma,
                                              rstd=rstd, zdz=zdz13, dresidual=dres),
        coda_bf16=lambda: be.norm_residual_bwd(da=da13, weight=w13, x=x, gamma=gamma, rstd=rstd, zdz=zdz13, dresidual=dres),
        bare_gemm=[scaled_mm(daq13, w13q_t)], eager=b2_eager(daq13, w13q_t, s_g, s_w13))))

    # fp8_mlp_wgrad: dW13 = da^T H as torchao's float8 weight gradient, with the amaxes B3 and F1 report
    # (the program: cast-and-transpose of both bf16 operands, _scaled_mm with slow accumulation); bare
    # GEMM: cuBLAS fp8 on copies made beforehand; eager: torchao's steps, amax passes included
    daq13_t, h8_t = daq13.t().contiguous(), h8.t().contiguous()
    amax13, amax_h = da13.float().abs().amax(), h.float().abs().amax()

    def wgrad_eager():
        g8, s_g8, x8, s_x8 = wgrad_fp8_operands(da13, None, h, None)  # amax passes and casts, eagerly
        return torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=s_g8, scale_b=s_x8,
                                out_dtype=bf, use_fast_accum=False)

    out.append(("wgrad_fp8_w13", "bwd", dict(
        coda=lambda: be.wgrad_fp8(grad=da13, grad_amax=amax13, inp=h, inp_amax=amax_h, out_dtype=bf),
        coda_bf16=lambda: be.wgrad(grad=da13, inp=h, out_dtype=bf),
        bare_gemm=[lambda: torch._scaled_mm(daq13_t, h8_t.t(), scale_a=one, scale_b=one, out_dtype=bf)],
        eager=wgrad_eager)))

    # the per-step weight pass (amax + cast of W13)
    out.append(("quantize_tensorwise", "fwd", dict(
        coda=lambda: be.quantize_tensorwise(w=w13), bare_gemm=[], eager=lambda: quantize_e4m3(
            w13.float(), inv_scale_from_amax(w13.float().abs().amax())))))
    assert h8.dtype == E4M3
    return out


def _liger_flce(hf, wout, tgt):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run():
        x_ = hf.detach().requires_grad_()
        w_ = wout.detach().requires_grad_()
        loss = loss_fn(w_, x_, tgt)
        loss.backward()

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--ops", nargs="*", default=None)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the e4m3 programs, written to kernels_fp8_<gpu>_d<d>.json")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    have_liger = _liger()
    device = torch.cuda.get_device_name()
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    out_dir = os.environ.get("OUT", "benchmarks/results")
    for d in args.dims:
        gen = torch.Generator(device="cuda").manual_seed(d)
        results = []
        for op, direction, fns in (fp8_cases if args.precision == "fp8" else cases)(d, gen):
            if args.ops and op not in args.ops:
                continue
            t0 = time.perf_counter()
            row = {"op": op, "direction": direction, "M": M, "d": d, "precision": args.precision, "ms": {}}
            row["ms"]["coda"] = _bench(fns["coda"])
            if "coda_bf16" in fns:
                row["ms"]["coda_bf16"] = _bench(fns["coda_bf16"])
            row["first_call_s"] = round(time.perf_counter() - t0, 1)
            gemms = [_bench(g) for g in fns["bare_gemm"]]
            row["ms"]["bare_gemm"] = sum(gemms) if gemms else None
            row["ms"]["eager"] = _try(fns["eager"])
            row["ms"]["torch_compile"] = _try(torch.compile(fns["eager"], dynamic=False))
            liger = None
            if fns.get("liger_kind") == "flce":
                if have_liger:
                    liger = _try(_liger_flce(*fns["liger_args"]))
                    row["liger_note"] = "LigerFusedLinearCrossEntropyLoss (no norm backward)"
                else:
                    row["liger_note"] = "liger-kernel is not installed on the benchmark host"
            else:
                row["liger_note"] = "Liger has no fused op for this program"
            row["ms"]["liger"] = liger
            if op == "lm_head_ce":
                torch.cuda.empty_cache()
                row["peak_gib"] = {"coda": _peak(fns["coda"]), "eager_full_logits": _peak(fns["eager"])}
            if row["ms"]["bare_gemm"]:
                row["coda_over_bare_gemm"] = row["ms"]["coda"] / row["ms"]["bare_gemm"]
            if row["ms"]["torch_compile"]:
                row["speedup_vs_compile"] = row["ms"]["torch_compile"] / row["ms"]["coda"]
            print(json.dumps(row), flush=True)
            results.append(row)
            torch.cuda.empty_cache()
        doc = {
            **header(),
            "autotune": os.environ.get("CODA_TITAN_AUTOTUNE", "1") != "0",
            "timing": "triton.testing.do_bench median (warmup 25 ms, rep 200 ms) after one untimed call",
            "results": results,
        }
        prefix = "kernels_fp8_" if args.precision == "fp8" else "kernels_"
        path = os.path.join(out_dir, f"{prefix}{slug}_d{d}.json")
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
