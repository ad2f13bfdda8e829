"""Run by tests/test_norm_residual_bwd.py in a subprocess with TRITON_INTERPRET=1: B2's epilogue vectors in one
Triton launch (``kernels/cute/row_vectors.py``) on CPU tensors, through Triton's interpreter, against the eager
ops the B2 op ran before (``-(r * r / d) * zdz`` and ``gamma.float() * sc``), bit for bit. Prints one JSON line
of measurements; the test judges them."""

import json

import torch
from interpreter_stub import cute_module, refuses

rv = cute_module("row_vectors")


def bits_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


torch.manual_seed(0)
got = {}
# rows past d and columns past M (both orders of M and d), gamma in bf16 and fp32, rstd / zdz as (M,) and (M, 1)
for m, d, gdt, col in ((3000, 2048, torch.bfloat16, False), (1000, 2048, torch.float32, True), (70, 3072, torch.bfloat16, True)):
    rstd = torch.rand(m) * 4 + 0.05
    zdz = torch.randn(m) * 1e3
    gamma = (torch.randn(d) * 0.5 + 1).to(gdt)
    sc = torch.tensor([2.0**-9 * 1.37])
    r2 = (rstd[:, None], zdz[:, None]) if col else (rstd, zdz)
    corr, w = rv.b2_vectors(*r2, gamma, d)
    _, w_sc = rv.b2_vectors(*r2, gamma, d, sc)
    want = -(rstd * rstd * torch.tensor(1.0 / d, dtype=torch.float32)) * zdz
    got[f"{m}x{d}_{gdt}"] = {
        "corr_apart": bits_apart(corr, want), "w_apart": bits_apart(w, gamma.float()),
        "w_sc_apart": bits_apart(w_sc, gamma.float() * sc), "shapes": [list(corr.shape), list(w.shape)],
        "dtypes": [str(corr.dtype), str(w.dtype)],
        # the division the CPU reference computes: the same value where 1 / d is exact
        "pow2_matches_division": d & (d - 1) != 0 or bits_apart(corr, -(rstd * rstd / d) * zdz) == 0,
    }
# the fp8 B2's amax fold: partials >= 0 of a few shapes (the last block ragged), against the three eager ops
for shape, dt in (((3000, 11), torch.bfloat16), ((64, 16), torch.float16), ((5, 3), torch.bfloat16),
                  ((2049, 300), torch.bfloat16)):  # (the last: past 128 blocks, rv.FOLD_PROGRAMS_LARGE programs)
    parts = torch.rand(shape) * torch.exp2(torch.randint(-20, 10, shape).float())
    want = parts.amax().to(dt).float()
    got[f"fold_{shape[0]}x{shape[1]}_{dt}"] = {"apart": bits_apart(rv.fold_amax(parts, dt).reshape(1), want.reshape(1)),
                                               "dtype": str(rv.fold_amax(parts, dt).dtype)}
# maxima halfway between two bf16 values (nearest even: down, then up)
got["fold_ties_apart"] = sum(bits_apart(rv.fold_amax(torch.tensor(v)).reshape(1), torch.tensor(v).amax().bfloat16().float().reshape(1))
                             for v in ([0.5, 1 + 2.0**-8], [1 + 3 * 2.0**-8, 0.25]))
# unrounded (fp32): the partials' own largest value
pr = torch.randn(3000, 11) * 1e3
got["fold_fp32_apart"] = bits_apart(rv.fold_amax(pr.abs(), torch.float32).reshape(1), pr.abs().amax().reshape(1))
pr = torch.randn(16384, 20) * 1e3  # (past 128 blocks: the larger program count, the count reset for the next call)
pr[16383, 19] = 1e6  # (the largest in the last, ragged block)
got["fold_fp32_large_apart"] = bits_apart(rv.fold_amax(pr.abs(), torch.float32).reshape(1), pr.abs().amax().reshape(1))
inv = torch.tensor([57344.0 / 3.7])  # (B3's: partials in units of an e5m2 scale, divided by it, rounded to nearest)
got["fold_div_apart"] = bits_apart(rv.fold_amax(pr.abs() * inv, torch.float32, div=inv).reshape(1),
                                   ((pr.abs() * inv).amax() / inv).reshape(1))
got["fold_programs"] = [rv.fold_programs(n) for n in (2048 * 128, 2048 * 128 + 1, 16384 * 20)]
got["fold_after_large_apart"] = bits_apart(rv.fold_amax(torch.tensor([[0.5, 3.0]]), torch.float32).reshape(1),
                                           torch.tensor([3.0]))
parts = torch.rand(100, 7)
parts[3, 2], parts[50, 1] = float("inf"), float("nan")
got["fold_nan_wins"] = bool(rv.fold_amax(parts).isnan()) and bool(parts.amax().isnan())
parts[50, 1] = 1.0
got["fold_inf"] = float(rv.fold_amax(parts)) == float("inf")
g = torch.ones(8)
got["refusals"] = {
    "gamma_shape": refuses(rv.b2_vectors, torch.ones(4), torch.ones(4), g, 16, says="gamma (d,)"),
    "zdz_count": refuses(rv.b2_vectors, torch.ones(4), torch.ones(5), g, 8, says="rstd and zdz"),
    "scale_dtype": refuses(rv.b2_vectors, torch.ones(4), torch.ones(4), g, 8, torch.ones(1, dtype=torch.float64),
                           says="fp32 scale"),
    "fold_dtype": refuses(rv.fold_amax, torch.ones(4, dtype=torch.bfloat16), says="fp32 partials"),
    "fold_div_rounded": refuses(rv.fold_amax, torch.ones(4), torch.bfloat16, torch.ones(1), says="unrounded fp32"),
    "fold_round_to": refuses(rv.fold_amax, torch.ones(4), torch.float64, says="bf16, fp16 or fp32"),
}
print(json.dumps(got))
