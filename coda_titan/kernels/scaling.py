"""FP8 formats and scale math, shared by every fp8 program (``[coda] precision = "fp8"``).

Recipe (docs/fp8.md gives each site's choice and why):

* **Formats.** e4m3 for forward operands (activations and weights), e5m2 for gradients, as
  torchao's tensorwise recipe. Every cast saturates (``sat``) and rounds to nearest even, but one: the
  LM head's dW codes of da (``fp8_lm_head_dw``) round stochastically (``quantize_e5m2_sr``).
* **Tensorwise scales.** ``inv = fmax / amax`` maps a tensor onto the format's range:
  ``q = sat(t * inv)`` and ``t ~= q * s`` with ``s = 1 / inv`` (torchao's ``amax_to_scale``).
* **Where the amax comes from.** Weights: current (each forward, the weight pass in ``gemm``).
  Activations written by a producer epilogue: delayed (the site's amax history in
  ``coda_titan.model.fp8_scaling``), because a tile is stored before the tensor's amax exists.
  Weight-gradient operands: current, rounded down to a power of two (``pow2_floor``).
* **Scales in the epilogue.** A GEMM on fp8 operands accumulates in units of ``s_a * s_w``
  (``dequant_scale``); the consumer folds that scalar into a vector its epilogue reads anyway.
"""

from __future__ import annotations

import torch

from ._common import ROW_BLOCK, by_row_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E5M2 = torch.float8_e5m2  # gradients: range over precision
E5M2_MAX = 57344.0
AMAX_EPS = 1e-12  # torchao's floor on amax (an all-zero tensor gets a finite scale)


def inv_scale_from_amax(amax: torch.Tensor, fmax: float = E4M3_MAX) -> torch.Tensor:
    """``fmax / amax`` in fp32 (fp64 for fp64 amax), with amax floored at 1e-12."""
    dt = torch.float64 if amax.dtype == torch.float64 else torch.float32
    return fmax / amax.to(dt).clamp(min=AMAX_EPS)


def amax_abs(t: torch.Tensor) -> torch.Tensor:
    """max |t| in ``t``'s dtype (NaN if any element is NaN), as ``t.abs().amax()`` but in one reduction
    that reads ``t`` once and stores no ``|t|``: the eager amax of a gradient before its cast."""
    return torch.linalg.vector_norm(t, float("inf"))


def pow2_floor(inv_scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= ``inv_scale`` (torchao's ``round_scales_to_power_of_2``). Scaling
    by a power of two is exact, so an element's fp8 rounding no longer depends on the amax: it is
    the element's own rounding to the format's mantissa, and the amax only picks the window of
    binades (at most one binade of range given up)."""
    return torch.exp2(torch.floor(torch.log2(inv_scale)))


def dequant_scale(inv_a: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """s_a * s_w (0-dim) for an operand quantized with ``inv_a`` and a weight of scale ``s_w``: the
    unit of the fp8 GEMM's accumulator, folded into the consumer's epilogue."""
    return (s_w / inv_a).reshape(())


def quantize_e4m3(t: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """sat(t * inv_scale) rounded to nearest even e4m3. ``t`` in its compute dtype, inv a scalar."""
    return (t * inv_scale.to(t.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def e4m3_step(t: torch.Tensor) -> torch.Tensor:
    """The e4m3 rounding step at each value of ``t`` (values on the scaled grid): 2^-3 of |t| among
    the normals (|t| >= 2^-6), the subnormal spacing 2^-9 below. One step is a rounding; more is
    something else."""
    return torch.where(t.abs() >= 2**-6, t.abs() * 2**-3, torch.full_like(t, 2**-9))


def quantize_e5m2(t: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """sat(t * inv_scale) rounded to nearest even e5m2 (the gradient format)."""
    return (t * inv_scale.to(t.dtype)).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2)


SR_DROP = 21  # fp32 mantissa bits e5m2 drops (23 - 2): the random increment's width


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 integer hash (a bijection of 32-bit words with low avalanche bias) on int64 tensors
    holding 32-bit words, as ``ce_grad_pass.lowbias32`` computes it in uint32 (products split so that no int64
    product overflows)."""
    m = 0xFFFFFFFF
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = x ^ (x >> shift)
        x = (x * (mul & 0xFFFF) + (((x * (mul >> 16)) & 0xFFFF) << 16)) & m
    return x ^ (x >> 16)


def sr_words(seed: int | torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The 32-bit random words (int64) of the elements at ``offsets`` (their flat indices in the batch) for
    ``seed``: lowbias32(offset mod 2^32 ^ lowbias32(seed mod 2^32)), a full hash of each element's counter."""
    key = lowbias32(torch.as_tensor(seed, dtype=torch.int64, device=offsets.device) & 0xFFFFFFFF)
    return lowbias32((offsets & 0xFFFFFFFF) ^ key)


def sr_seed_of(targets: torch.Tensor) -> torch.Tensor:
    """A batch's stochastic-rounding seed (the LM head's dW codes, ``fp8_lm_head_dw``; both backends): a hash of its
    targets and their positions, a 0-dim int64 on their device (no host sync). A step's bits then depend on its
    batch alone, so that a run repeats itself and a resumed run draws the bits the run it resumes drew."""
    t = targets.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    pos = lowbias32(torch.arange(1, t.numel() + 1, device=t.device) & 0xFFFFFFFF)
    return lowbias32(t ^ pos).sum() & 0xFFFFFFFF


def sr_offsets(start: int, stop: int, cols: int, device) -> torch.Tensor:
    """Each element's counter for the stochastic rounding of rows [start, stop): its flat index in the batch."""
    return torch.arange(start, stop, device=device)[:, None] * cols + torch.arange(cols, device=device)


def quantize_e5m2_sr(t: torch.Tensor, inv_scale: torch.Tensor, seed: int | torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """sat(t * inv_scale) rounded stochastically to e5m2: up (in magnitude) with probability the fraction of a
    step it lies past the code below, so that E[q] = sat(t * inv_scale). The scaled value is taken in fp32; its
    low 21 bits plus the top 21 of its random word (``sr_words``) carry into the kept bits or not, then the
    21 bits are cleared (below e5m2's normal range, 2^-14, the result is rounded to nearest even instead).
    ``seed``: an int or a 0-dim integer tensor (``sr_seed_of``), taken mod 2^32; ``offsets`` (t's shape, int64):
    each element's flat index in the batch (``sr_offsets``). Bit for bit the Triton pass's codes (``ce_grad_pass``,
    ``fp8_lm_head_dw``) of the same fp32 values."""
    v = (t * inv_scale.to(t.dtype)).clamp(-E5M2_MAX, E5M2_MAX).float()
    bits = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rnd = sr_words(seed, offsets) >> (32 - SR_DROP)
    kept = ((bits + rnd) & (0xFFFFFFFF ^ ((1 << SR_DROP) - 1)))
    kept = torch.where(kept >= 2**31, kept - 2**32, kept).to(torch.int32)
    return kept.view(torch.float32).to(E5M2)


def quantize_e5m2_site(t: torch.Tensor, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tq, amax |t|): a gradient site's cast, with its delayed ``inv_scale`` or, calibrating (None),
    the current amax's E5M2_MAX / amax; the amax goes to the site's history either way (B1's and B3's da).
    The amax is taken per row first (the same value: a max is exact in any order), so that where
    inductor traces it (B1) it can join the row reductions over the same rows (B1's zdz) instead of a
    whole-tensor reduction of its own that reads the inputs again."""
    amax = t.abs().amax(-1).amax()
    return quantize_e5m2(t, inv_scale_from_amax(amax, E5M2_MAX) if inv_scale is None else inv_scale), amax


def quantize_e5m2_site_rows(t: torch.Tensor, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_e5m2_site`` over ``ROW_BLOCK`` rows at a time (``by_row_blocks``): the same amax (a max is exact
    in any order) and codes (the cast is per element), with one block's temporaries alive instead of the whole's.
    Eager code for B3's reference, which the fp8 calibration step (a run's first) runs at a training step's size
    (docs/fp8.md); not for inductor to trace (B1 keeps ``quantize_e5m2_site``)."""
    amax = torch.stack([b.abs().amax() for b in t.split(ROW_BLOCK)]).amax()
    inv = inv_scale_from_amax(amax, E5M2_MAX) if inv_scale is None else inv_scale
    return by_row_blocks(lambda b: (quantize_e5m2(b, inv),), t)[0], amax


def compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype of an fp8 program: fp32, or fp64 when the outputs are fp64 (tests)."""
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def check_e4m3(*operands: torch.Tensor) -> None:
    if any(t.dtype != E4M3 for t in operands):
        raise TypeError(f"fp8 programs take e4m3 operands, got {[t.dtype for t in operands]}")


def fp8_mm(aq: torch.Tensor, bq: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """aq @ bq^T with e4m3 operands, products exact and accumulated in ``ct`` (the tensor core's
    fp32 accumulation; fp64 for the tests)."""
    check_e4m3(aq, bq)
    return aq.to(ct) @ bq.to(ct).t()
