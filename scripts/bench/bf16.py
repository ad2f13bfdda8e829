"""BF16 programs: one setup per program, (op, direction, providers). Providers: ``coda`` (the cute
kernel through torch.ops.coda), ``bare_gemm`` (torch.mm of the same GEMMs), ``eager`` (the unfused
computation stock TorchTitan runs for the same work; ``torch_compile`` is it under inductor), and
Liger where it has an op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import BF, EPS, M, SEQLEN, VOCAB, Setup, rms_bwd_unfused


def residual_rms(s: Setup):
    """F1: out-projection + residual + partial RMS (stock: linear, add, rms_norm)."""
    d, k = s.d, s.hq * s.hd
    y, wo, res = s.r(M, k), s.r(d, k, scale=k**-0.5), s.r(M, d)

    def eager():
        x = res + F.linear(y, wo)
        return x, F.rms_norm(x, (d,), s.gamma, EPS)

    return "residual_rms", "fwd", dict(
        coda=lambda: s.be.residual_rms(y=y, weight=wo, residual=res, gamma=s.gamma, tile_n=128),
        bare_gemm=[lambda: torch.mm(y, wo.t())], eager=eager)


def norm_swiglu(s: Setup):
    """F2: W13 GEMM + deferred rstd + SwiGLU (stock: two linears on the normalized input, silu * up)."""
    w1, w3 = s.w1_w3

    def eager():
        n = F.rms_norm(s.h, (s.d,), None, EPS)
        return F.silu(F.linear(n, w1)) * F.linear(n, w3)

    return "norm_swiglu", "fwd", dict(
        coda=lambda: s.be.norm_swiglu(h=s.h, rstd=s.rstd, w13=s.w13),
        bare_gemm=[lambda: torch.mm(s.h, s.w13.t())], eager=eager)


def qkv_eager(s: Setup, linears):
    """Stock's QKV block: rms_norm, three linears, apply_rotary_emb."""
    from torchtitan.models.llama3.model.model import apply_rotary_emb

    lq, lk, lv = linears

    def eager():
        n = F.rms_norm(s.h, (s.d,), None, EPS)
        xq = lq(n).view(s.bs, SEQLEN, s.hq, s.hd)
        xk = lk(n).view(s.bs, SEQLEN, s.hkv, s.hd)
        xq, xk = apply_rotary_emb(xq, xk, s.freqs_cis)
        return xq, xk, lv(n)

    return eager


def norm_rope(s: Setup):
    """F3: QKV GEMM + deferred rstd + RoPE."""
    wq, wk, wv = s.wqkv.split([s.hq * s.hd, s.hkv * s.hd, s.hkv * s.hd])
    linears = [lambda n, w=w: F.linear(n, w) for w in (wq, wk, wv)]
    return "norm_rope", "fwd", dict(
        coda=lambda: s.be.norm_rope(h=s.h, rstd=s.rstd, weight=s.wqkv, **s.rope),
        bare_gemm=[lambda: torch.mm(s.h, s.wqkv.t())], eager=qkv_eager(s, linears))


def rope_bwd(s: Setup):
    """B1: RoPE backward + zdz (stock: autograd's inverse rotation of dq, dk)."""
    from torchtitan.models.llama3.model.model import apply_rotary_emb

    dqkv, qkv = s.r(M, s.q), s.r(M, s.q)
    fc_conj = s.freqs_cis.conj()

    def eager():
        dq = dqkv[:, : s.hq * s.hd].reshape(s.bs, SEQLEN, s.hq, s.hd)
        dk = dqkv[:, s.hq * s.hd: (s.hq + s.hkv) * s.hd].reshape(s.bs, SEQLEN, s.hkv, s.hd)
        return apply_rotary_emb(dq, dk, fc_conj)

    return "rope_bwd", "bwd", dict(
        coda=lambda: s.be.rope_bwd(dy=dqkv, y=qkv, rstd=s.rstd, **s.rope), bare_gemm=[], eager=eager)


def b2_eager(s: Setup, gemm, x, dres):
    """Stock's B2 given its dgrad GEMM: the unfused RMSNorm backward plus the residual gradient."""

    def eager():
        dx, dgamma = rms_bwd_unfused(gemm(), x, s.gamma, s.rstd)
        return (dx + dres.float()).to(BF), dgamma

    return eager


def norm_residual_bwd(s: Setup):
    """B2: dgrad GEMM + RMSNorm/residual backward + dgamma (the QKV consumer's)."""
    da, x, zdz, dres = s.r(M, s.q), s.r(M, s.d), s.r(M, dtype=torch.float32), s.r(M, s.d)
    return "norm_residual_bwd", "bwd", dict(
        coda=lambda: s.be.norm_residual_bwd(da=da, weight=s.wqkv, x=x, gamma=s.gamma, rstd=s.rstd, zdz=zdz,
                                            dresidual=dres),
        bare_gemm=[lambda: torch.mm(da, s.wqkv)], eager=b2_eager(s, lambda: torch.mm(da, s.wqkv), x, dres))


def swiglu_bwd(s: Setup):
    """B3: down-projection dgrad + SwiGLU backward + zdz (stock: dgrad GEMM, silu/mul backward)."""
    dout, a = s.r(M, s.d), s.r(M, 2 * s.ff)
    g_pre, u_pre = a[:, 0::2].contiguous(), a[:, 1::2].contiguous()

    def eager():
        dy = torch.mm(dout, s.w2).float()
        g, u = g_pre.float(), u_pre.float()
        sg = torch.sigmoid(g)
        return (dy * u * sg * (1 + g * (1 - sg))).to(BF), (dy * g * sg).to(BF), (g * sg * u).to(BF)

    return "swiglu_bwd", "bwd", dict(
        coda=lambda: s.be.swiglu_bwd(dout=dout, w_down=s.w2, a=a, rstd=s.rstd),
        bare_gemm=[lambda: torch.mm(dout, s.w2)], eager=eager)


def lm_head_ce(s: Setup):
    """F4: chunked LM head + CE with its gradients (stock: rms_norm, full logits, CE, autograd)."""
    d = s.d
    xf, wout = s.r(M, d), s.r(VOCAB, d, scale=d**-0.5)
    tgt = torch.randint(0, VOCAB, (M,), generator=s.gen, device="cuda")
    hf = (xf.float() * s.gamma.float()).to(BF)
    rf = torch.rsqrt(xf.float().pow(2).mean(-1) + EPS)

    def eager():
        x_, g_, w_ = (t.detach().requires_grad_() for t in (xf, s.gamma, wout))
        loss = F.cross_entropy(F.linear(F.rms_norm(x_, (d,), g_, EPS), w_).float(), tgt, reduction="sum")
        loss.backward()
        return loss

    logits_buf = torch.empty(M, VOCAB, device="cuda", dtype=BF)
    dl = torch.empty(M, VOCAB, device="cuda", dtype=BF)
    return "lm_head_ce", "fwd", dict(
        coda=lambda: s.be.lm_head_ce(h=hf, rstd=rf, x=xf, gamma=s.gamma, weight=wout, targets=tgt,
                                     chunk_rows=2048, compute_grad=True),
        bare_gemm=[lambda: torch.mm(hf, wout.t(), out=logits_buf), lambda: torch.mm(dl, wout),
                   lambda: torch.mm(dl.t(), hf)],
        eager=eager, liger=liger_flce(hf, wout, tgt))


def liger_flce(hf, wout, tgt):
    """Liger's fused linear cross-entropy on the same inputs, or None where Liger is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run():
        loss_fn(wout.detach().requires_grad_(), hf.detach().requires_grad_(), tgt).backward()

    return run


PROGRAMS = (residual_rms, norm_swiglu, norm_rope, rope_bwd, norm_residual_bwd, swiglu_bwd, lm_head_ce)
