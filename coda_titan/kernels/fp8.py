"""FP8 forward programs: F2 and F3 with e4m3 operands, and the producers that quantize their input.

Recipe (``[coda] precision = "fp8"``; see docs/fp8_design.md for why each choice):

* **e4m3, tensorwise scales, fp32 accumulation.** A scale ``inv = 448 / amax`` maps a tensor onto
  the e4m3 range, ``q = sat(t * inv)`` rounded to nearest even (torchao's ``amax_to_scale`` and
  saturated cast), and ``t ~= q * s`` with ``s = 1 / inv``.
* **Weights: dynamic.** Each forward quantizes W13 and W_qkv from their current bf16 values
  (``quantize_tensorwise``, the weight pass), as torchao's tensorwise recipe does: every layer's
  in one call at the start of the forward (``fp8_layer_weights``).
* **Activations: delayed.** The A operand of F2 / F3 is H = X * gamma, written by the *producer*
  epilogue (F1, or the prologue) tile by tile. A current-amax scale is known only after the last
  tile of the whole tensor is written, so the producer quantizes with the scale of the amax
  history of that site (the max over the last ``history`` steps, Transformer Engine's delayed
  scaling) and reports the current amax, which enters the history. Values beyond the history's
  range saturate at +-448 instead of overflowing. The first step has no history: it is
  calibrated with current scaling (``inv_scale=None`` below).
* **Scales in the epilogue.** The consumer's accumulator is in units of ``s_a * s_w``. That scalar
  multiplies the deferred-rstd column vector (F3: r' = r * s_a * s_w) or the accumulator itself
  (F2, which must also save the true-scale pre-activation for its backward).
* **Backward.** Gradients flow straight through the quantization (torchao's convention). With
  ``[coda] fp8_dgrad = true`` (off by default: measured slower, docs/fp8_design.md) F3's dgrad
  (B1 -> B2) runs on fp8: B1 casts da to e5m2 with a current tensorwise scale, as torchao casts
  gradients, and B2 multiplies it with the e4m3 W_qkv^T of the weight pass; the scale s_da * s_w
  rides B2's gamma row vector and its dgamma partials. ``[coda] fp8_mlp_dgrad`` (on by default:
  measured faster) does the same for the MLP's dgrad da @ W13, with da cast in B3's epilogue under a
  delayed gradient scale (the amax history of that site, with ``fp8_grad_margin`` powers of two of
  headroom). ``[coda] fp8_mlp_wgrad`` computes W13's weight gradient on fp8 as torchao does
  (``wgrad_fp8``: current power-of-two scales, token-major e5m2 da and e4m3 H), with the amaxes that B3 and F1
  already reported. The other backward programs and wgrads are the BF16 ones, on the bf16 tensors
  the forward saved (docs/fp8_design.md says why: quack's SM90 packed-pair stores are 16-bit, and
  fp8 WGMMA operands must be K-major, so a weight gradient needs token-major copies).

Programs (all return the bf16 outputs in ``out_dtype``; fp64 throughout when the inputs are fp64,
which is how the CPU tests check the algebra):

    fp8_layer_weights  the weight pass of all layers: W13q, W_qkv,q and their scales
    rms_partial_fp8    prologue: H = X * gamma, S, Hq = sat(H * inv), amax |H|
    residual_rms_fp8   F1 (bf16 GEMM) whose epilogue also writes Hq and amax |H|
    norm_swiglu_fp8    F2: acc = Hq @ W13q^T; v = s * acc; a = v (saved); y = SwiGLU(r * v)
    norm_rope_fp8      F3: acc = Hq @ Wq^T;  p = (r * s) * acc; y = RoPE(p)
    rope_bwd_fp8       B1 + e5m2 da (current scale)
    norm_residual_bwd_fp8  B2 on e5m2 da and e4m3 W^T (F3's, or the MLP's with ``fp8_mlp_dgrad``)
    swiglu_bwd_fp8     B3 + e5m2 da (delayed scale, ``fp8_mlp_dgrad``) and amax |da|
    wgrad_fp8          dW = G^T X on e5m2 G and e4m3 X, current power-of-two scales (W13's, ``fp8_mlp_wgrad``)
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, interleave_rows, tile_sumsq
from .norm_residual_bwd import norm_residual_apply
from .norm_rope import norm_rope_torch, rope_bwd_acc
from .norm_swiglu import swiglu_bwd_acc
from .residual_rms import residual_acc

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E5M2 = torch.float8_e5m2  # gradients (torchao's tensorwise recipe): range over precision
E5M2_MAX = 57344.0
AMAX_EPS = 1e-12  # torchao's floor on amax (an all-zero tensor gets a finite scale)


def inv_scale_from_amax(amax: torch.Tensor, fmax: float = E4M3_MAX) -> torch.Tensor:
    """``fmax / amax`` in fp32 (fp64 for fp64 amax), with amax floored at 1e-12."""
    dt = torch.float64 if amax.dtype == torch.float64 else torch.float32
    return fmax / amax.to(dt).clamp(min=AMAX_EPS)


def pow2_floor(inv_scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= ``inv_scale`` (torchao's ``round_scales_to_power_of_2``). Scaling
    by a power of two is exact, so an element's fp8 rounding no longer depends on the amax: it is
    the element's own rounding to the format's mantissa, and the amax only picks the window of
    binades (at most one binade of range given up)."""
    return torch.exp2(torch.floor(torch.log2(inv_scale)))


def quantize_e4m3(t: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """sat(t * inv_scale) rounded to nearest even e4m3. ``t`` in its compute dtype, inv a scalar."""
    return (t * inv_scale.to(t.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_e5m2(t: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """sat(t * inv_scale) rounded to nearest even e5m2 (the gradient format)."""
    return (t * inv_scale.to(t.dtype)).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2)


def quantize_tensorwise_torch(*, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq, s): current-amax tensorwise e4m3 of ``w`` and its dequantization scale s = 1/inv (0-dim)."""
    wf = w.to(acc_dtype(w))
    inv = inv_scale_from_amax(wf.abs().amax())
    return quantize_e4m3(wf, inv), inv.reciprocal()


def fp8_layer_weights_torch(
    *, w1: list[torch.Tensor], w3: list[torch.Tensor], wq: list[torch.Tensor], wk: list[torch.Tensor],
    wv: list[torch.Tensor], w13_t: bool = False, wqkv_t: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The weight pass of every layer at once: (W13q per layer, their scales (L,), W_qkv,q per layer,
    their scales (L,), W13q^T per layer if ``w13_t``, W_qkv,q^T per layer if ``wqkv_t``), with W13 =
    interleave_rows(w1, w3) and W_qkv = cat(wq, wk, wv), each quantized as ``quantize_tensorwise``.
    The transposed copies are B2's fp8 dgrad operands (fp8 WGMMA operands must be K-major, and B2
    contracts over the weight's rows); empty lists when not asked for. One call per forward, so that
    the host launches it once, not 2 L times."""
    if not (len(w1) == len(w3) == len(wq) == len(wk) == len(wv)):
        raise ValueError(f"need one weight of each kind per layer, got {[len(t) for t in (w1, w3, wq, wk, wv)]}")
    w13 = [quantize_tensorwise_torch(w=interleave_rows(a, b)) for a, b in zip(w1, w3)]
    qkv = [quantize_tensorwise_torch(w=torch.cat([q, k, v])) for q, k, v in zip(wq, wk, wv)]
    stack = lambda pairs: torch.stack([sc for _, sc in pairs]) if pairs else torch.empty(0)  # noqa: E731
    t = lambda pairs, want: [q.t().contiguous() for q, _ in pairs] if want else []  # noqa: E731
    return [q for q, _ in w13], stack(w13), [q for q, _ in qkv], stack(qkv), t(w13, w13_t), t(qkv, wqkv_t)


def _h_and_q(xf: torch.Tensor, gamma: torch.Tensor, inv_scale: torch.Tensor | None, out_dtype: torch.dtype):
    hf = xf * gamma.to(xf.dtype)
    amax = hf.abs().amax()
    inv = inv_scale_from_amax(amax) if inv_scale is None else inv_scale
    return hf.to(out_dtype), quantize_e4m3(hf, inv), amax


def rms_partial_fp8_torch(
    *, x: torch.Tensor, gamma: torch.Tensor, tile_n: int, inv_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H, S, Hq, amax) of the prologue; ``inv_scale=None`` quantizes with the current amax."""
    check_2d("x", x, gamma.shape[0])
    xf = x.to(acc_dtype(x, gamma))
    h, hq, amax = _h_and_q(xf, gamma, inv_scale, x.dtype)
    return h, tile_sumsq(xf, tile_n), hq, amax


def residual_rms_fp8_torch(
    *,
    y: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    tile_n: int,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S, Hq, amax): F1 (bf16 GEMM) whose epilogue also quantizes H for the next consumer."""
    xf = residual_acc(y, weight, residual)
    h, hq, amax = _h_and_q(xf, gamma, inv_scale, residual.dtype)
    return xf.to(residual.dtype), h, tile_sumsq(xf, tile_n), hq, amax


def _check_e4m3(aq: torch.Tensor, bq: torch.Tensor) -> None:
    if aq.dtype != E4M3 or bq.dtype != E4M3:
        raise TypeError(f"fp8 programs take e4m3 operands, got {aq.dtype} and {bq.dtype}")


def _fp8_mm(aq: torch.Tensor, bq: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """aq @ bq^T with e4m3 operands, products exact and accumulated in ``ct`` (the tensor core's
    fp32 accumulation; fp64 for the tests)."""
    _check_e4m3(aq, bq)
    return aq.to(ct) @ bq.to(ct).t()


def _compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def norm_swiglu_fp8_torch(
    *, hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, a) as ``norm_swiglu``, from e4m3 Hq and W13q; ``scale`` = s_a * s_w (0-dim)."""
    check_2d("hq", hq, w13q.shape[1])
    ct = _compute_dtype(out_dtype)
    v = _fp8_mm(hq, w13q, ct) * scale.to(ct)
    z = v * rstd.to(ct)[:, None]
    y = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    return y.to(out_dtype), v.to(out_dtype)


def norm_rope_fp8_torch(
    *,
    hq: torch.Tensor,
    rstd: torch.Tensor,
    weight_q: torch.Tensor,
    scale: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Post-RoPE qkv as ``norm_rope``, from e4m3 Hq and W_qkv,q; the rstd vector carries ``scale``."""
    check_2d("hq", hq, weight_q.shape[1])
    _check_e4m3(hq, weight_q)
    ct = _compute_dtype(out_dtype)
    y = norm_rope_torch(
        h=hq.to(ct), rstd=rstd.to(ct) * scale.to(ct), weight=weight_q.to(ct), freqs=freqs,
        seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim,
    )
    return y.to(out_dtype)


# --- FP8 backward: B1 -> B2 of the QKV consumer -----------------------------------------------------


def rope_bwd_fp8_torch(
    *,
    dy: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, zdz, daq, s): B1 as ``rope_bwd``, which also casts its output to e5m2 with a current
    tensorwise scale (torchao's treatment of gradients): daq = sat(da * inv), s = 1 / inv. B1 is a
    pass of its own (no GEMM), so the amax is one more reduction in it, not a round trip."""
    da, zdz = rope_bwd_acc(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)
    inv = inv_scale_from_amax(da.abs().amax(), E5M2_MAX)
    return da.to(dy.dtype), zdz, quantize_e5m2(da, inv), inv.reciprocal()


def norm_residual_bwd_fp8_torch(
    *,
    daq: torch.Tensor,
    weight_tq: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B2 on fp8 operands: acc = daq @ weight_tq^T (e5m2 x e4m3, exact products, fp32 sum; weight_tq
    is W^T, (d, N)), in units of ``scale`` = s_da * s_w, then ``norm_residual_bwd``'s epilogue. The
    kernel folds ``scale`` into the gamma row vector and the dgamma partials."""
    check_2d("daq", daq, weight_tq.shape[1])
    check_2d("x", x, weight_tq.shape[0])
    if daq.dtype not in (E4M3, E5M2) or weight_tq.dtype != E4M3:
        raise TypeError(f"B2 fp8 takes an e5m2/e4m3 gradient and an e4m3 weight, got {daq.dtype} and {weight_tq.dtype}")
    ct = _compute_dtype(x.dtype)
    acc = (daq.to(ct) @ weight_tq.to(ct).t()) * scale.to(ct)
    return norm_residual_apply(acc, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)


# --- FP8 backward: B3 -> B2 of the MLP --------------------------------------------------------------


def swiglu_bwd_fp8_torch(
    *,
    dout: torch.Tensor,
    w_down: torch.Tensor,
    a: torch.Tensor,
    rstd: torch.Tensor,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, y, zdz, daq, amax): B3 as ``swiglu_bwd`` (bf16 GEMM), whose epilogue also writes da as
    e5m2, daq = sat(da * inv_scale) from the fp32 da (before its bf16 rounding), in da's interleaved
    gate/up column order, and reports amax |da|. The scale is delayed, like the activations' (B3's
    epilogue writes daq tile by tile, before the amax of the whole da is known): the max of the
    gradient site's amax history; ``inv_scale=None`` (the calibration step) uses the current amax."""
    da, y, zdz = swiglu_bwd_acc(dout=dout, w_down=w_down, a=a, rstd=rstd)
    amax = da.abs().amax()
    inv = inv_scale_from_amax(amax, E5M2_MAX) if inv_scale is None else inv_scale
    return da.to(a.dtype), y.to(a.dtype), zdz, quantize_e5m2(da, inv), amax


def wgrad_fp8_operands(
    grad: torch.Tensor, grad_amax: torch.Tensor | None, inp: torch.Tensor, inp_amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gq, s_g, xq, s_x): grad as e5m2 and inp as e4m3, each with the current tensorwise scale of
    its amax (computed here when None) rounded down to a power of two, in the compute dtype's
    arithmetic (fp64 for fp64 inputs).

    Why a power of two: with ``fmax / amax`` itself, the whole rounding grid moves with the amax, a
    single element. Two correct runs whose da differ at the fp8-noise level (cute and torch
    backends: measured, the 1B model's amax |da| 6% apart in one layer, ``probe_fp8_model_grads``)
    then round every element independently. With a power-of-two scale the rounding of an element
    is its own, whatever the amax."""
    ct = torch.float64 if grad.dtype == torch.float64 else torch.float32
    g, x = grad.to(ct), inp.to(ct)
    inv_g = pow2_floor(inv_scale_from_amax(g.abs().amax() if grad_amax is None else grad_amax.to(ct), E5M2_MAX))
    inv_x = pow2_floor(inv_scale_from_amax(x.abs().amax() if inp_amax is None else inp_amax.to(ct)))
    return quantize_e5m2(g, inv_g), inv_g.reciprocal(), quantize_e4m3(x, inv_x), inv_x.reciprocal()


def wgrad_fp8_torch(
    *, grad: torch.Tensor, grad_amax: torch.Tensor | None, inp: torch.Tensor, inp_amax: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW = grad^T @ inp on fp8 operands, torchao's float8 weight gradient: grad (M, N) cast to e5m2
    and inp (M, K) to e4m3, each with a *current* tensorwise scale rounded down to a power of two
    (torchao's ``round_scales_to_power_of_2``; ``wgrad_fp8_operands`` says why), exact products summed in fp32
    (fp64 when ``out_dtype`` is fp64), times s_g * s_x. The amaxes come from the epilogues that
    produced the two tensors (B3 reports amax |da|, F1 amax |H|), so no pass of its own computes
    them (None: computed here). The kernel makes the casts token-major copies (SM90 fp8 MMAs read
    K-major operands only, and K is the token axis), one cast-and-transpose pass per operand, as
    torchao's recipe does."""
    check_2d("grad", grad)
    check_2d("inp", inp)
    if grad.shape[0] != inp.shape[0]:
        raise ValueError(f"grad and inp need the same rows, got {tuple(grad.shape)} and {tuple(inp.shape)}")
    gq, s_g, xq, s_x = wgrad_fp8_operands(grad, grad_amax, inp, inp_amax)
    ct = _compute_dtype(out_dtype)
    return ((gq.to(ct).t() @ xq.to(ct)) * (s_g * s_x).to(ct)).to(out_dtype)
