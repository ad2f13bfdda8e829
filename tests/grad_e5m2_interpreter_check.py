"""Run by tests/test_gemm.py in a subprocess with TRITON_INTERPRET=1: ``quantize_grad``'s Triton passes
(``grad_e5m2`` in ``kernels/cute/transpose_8bit.py``) on CPU tensors through Triton's interpreter, against
the reference ``quantize_grad`` (``kernels/casts.py``). Prints one JSON line of measurements; the test
judges them. The interpreter's own fp32 -> e5m2 conversion is not the hardware's rounding (the GPU test
checks that), so the codes are compared on values whose scaled value is an e5m2 number."""

import json

import torch
import triton
import triton.language as tl
from interpreter_stub import cute_module, refuses

from coda_titan.kernels import casts as ref
from coda_titan.kernels.scaling import AMAX_EPS, E5M2_MAX, inv_scale_from_amax, pow2_floor

tr = cute_module("transpose_8bit")


@triton.jit
def _inv_of(amax_ptr, inv_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + offs, mask=offs < N, other=1.0)
    tl.store(inv_ptr + offs, tr.pow2_inv_scale(amax, E5M2_MAX, AMAX_EPS), mask=offs < N)


got = {}
# the scale of every amax a bf16 gradient can have (every non-negative bf16 bit pattern: zero, subnormals,
# normals, inf, NaN) against the reference's pow2_floor(E5M2_MAX / max(amax, 1e-12)), bit for bit
amax = torch.arange(0, 0x8000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
inv = torch.empty_like(amax)
_inv_of[(triton.cdiv(amax.numel(), 1024),)](amax, inv, amax.numel(), BLOCK=1024)
want = pow2_floor(inv_scale_from_amax(amax, E5M2_MAX))
same = (inv.view(torch.int32) == want.view(torch.int32)) | (inv.isnan() & want.isnan())
got["scales"] = {"n": amax.numel(), "apart": int((~same).sum()), "nan_kept": bool(inv[amax.isnan()].isnan().all())}

torch.manual_seed(0)
for m, k, scale in ((128, 192, 2.0**-7), (100, 70, 2.0**9), (1, 65, 1.0)):
    codes = torch.randint(0, 256, (m, k), dtype=torch.uint8).view(torch.float8_e5m2).float()
    x = (torch.where(codes.isfinite(), codes, 0.0) * scale).to(torch.bfloat16)  # (exact codes times a power of two)
    for token_major in (False, True):
        y, yt, s = tr.grad_e5m2(x, token_major=token_major)
        yq, s_ref = ref.quantize_grad(t=x)
        # and with the amax given (its producer's, ``edges.amax_token``): the cast pass alone, the same bytes
        y2, yt2, s2 = tr.grad_e5m2(x, token_major=token_major, amax=x.float().abs().amax())
        got[f"{m}x{k}_{token_major:d}"] = {
            "bytes_apart": int((y.view(torch.uint8) != yq.view(torch.uint8)).sum()),
            "t_bytes_apart": None if yt is None else int((yt.view(torch.uint8) != yq.t().contiguous().view(torch.uint8)).sum()),
            "t_contiguous": None if yt is None else yt.is_contiguous(),
            "s": float(s), "s_ref": float(s_ref), "shape": list(y.shape),
            "given_same": bool(torch.equal(y2.view(torch.uint8), y.view(torch.uint8)) and torch.equal(s2, s)
                               and (yt is None or torch.equal(yt2.view(torch.uint8), yt.view(torch.uint8)))),
        }
# a NaN anywhere: the amax and the scale are NaN, as the reference's (nothing saturates it away)
x = torch.ones(64, 96, dtype=torch.bfloat16)
x[37, 5] = float("nan")
y, yt, s = tr.grad_e5m2(x, token_major=True)
got["nan"] = {"s_nan": bool(s.isnan()), "ref_s_nan": bool(ref.quantize_grad(t=x)[1].isnan()),
              "codes_nan": bool(y.float().isnan().all()), "t_codes_nan": bool(yt.float().isnan().all())}
# an all-zero gradient: the floor 1e-12 on the amax, zero codes
y, _, s = tr.grad_e5m2(torch.zeros(16, 32, dtype=torch.bfloat16), token_major=False)
got["zeros"] = {"s": float(s), "s_ref": float(ref.quantize_grad(t=torch.zeros(16, 32, dtype=torch.bfloat16))[1]),
                "codes_zero": bool((y.view(torch.uint8) == 0).all())}
for bad in (x.t(), x.float()):
    got[f"refuses_{bad.dtype}_{bad.is_contiguous():d}"] = refuses(tr.grad_e5m2, bad, False, says="contiguous 2-d bf16")
got["refuses_amax"] = all(refuses(tr.grad_e5m2, x, False, a, says="one-element fp32 amax")
                          for a in (torch.ones(2), torch.ones((), dtype=torch.float64)))
# the delayed e4m3 cast of an activation (delayed_e4m3_t): exact e4m3 values times a power-of-two scale, codes
# in both layouts against the reference quantize_delayed with that scale, and the amax; values beyond the
# range saturate; a NaN is the amax (as the reference's)
for m, k in ((128, 192), (100, 70)):
    codes = torch.randint(0, 256, (m, k), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = (torch.where(codes.isfinite(), codes, 0.0) / 4.0).to(torch.bfloat16)
    x[0, :2] = torch.tensor([1e4, -1e4])
    inv = torch.tensor([4.0])
    y, yt, amax = tr.delayed_e4m3_t(x, inv)
    yq, amax_ref = ref.quantize_delayed(t=x, inv_scale=inv.reshape(()))
    got[f"delayed_{m}x{k}"] = {
        "bytes_apart": int((y.view(torch.uint8) != yq.view(torch.uint8)).sum()),
        "t_bytes_apart": int((yt.view(torch.uint8) != yq.t().contiguous().view(torch.uint8)).sum()),
        "t_contiguous": yt.is_contiguous(), "amax": float(amax), "amax_ref": float(amax_ref),
        "amax_dtype": str(amax.dtype), "saturated": [float(v) for v in y[0, :2].float()]}
x = torch.ones(64, 96, dtype=torch.bfloat16)
x[3, 70] = float("nan")
got["delayed_nan_amax"] = bool(tr.delayed_e4m3_t(x, torch.tensor([1.0]))[2].isnan())
for bad, inv in ((x.t(), torch.tensor([1.0])), (x, torch.tensor([1.0, 2.0]))):
    got[f"delayed_refuses_{bad.is_contiguous():d}_{inv.numel()}"] = refuses(tr.delayed_e4m3_t, bad, inv,
                                                                             says="delayed_e4m3_t takes")
print(json.dumps(got))
