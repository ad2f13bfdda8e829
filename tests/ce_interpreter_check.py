"""Run by tests/test_lm_head_ce.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): F4's
in-place gradient pass (``kernels/cute/ce_grad_pass.py``) on CPU tensors, through Triton's interpreter,
against the arithmetic of the inductor program it replaces (``kernels/cute/lm_head_ce._ce_grad_math``) and the
aten ops around it (``torch.logsumexp`` of the epilogue's per-N-tile partials, the loss term, B2's corr).
Prints one JSON line of measurements; the test judges them. (``coda_titan.kernels.cute`` imports quack,
which a CPU install lacks: its package is stood in for, so that only the Triton module loads.)"""

import functools
import json

import torch
from interpreter_stub import cute_function, cute_module, refuses

from coda_titan.kernels import lm_head_ce as ref
from coda_titan.kernels import scaling

ce_pass = cute_module("ce_grad_pass")
ce_grad_math = cute_function("lm_head_ce.py", "def _ce_grad_math", "@torch.library.register_kernel",
                             {"torch": torch, "ref": ref})
U = 2.0**-24  # (one fp32 unit, relative)

torch.manual_seed(0)
rows, vocab, tile, d = 6, 5000, 1024, 2048  # two blocks of 4096 columns, the second one partly masked
logits = (torch.randn(rows, vocab) * 3).bfloat16()
targets = torch.tensor([3, ref.IGNORE_INDEX, vocab - 1, 4095, 4096, 0])
rstd = torch.rand(rows) + 0.5
lf = logits.float()
# the epilogue's partials: each N tile's log-sum-exp (the last tile ragged), one row's last tile empty (-inf)
parts = torch.stack([torch.logsumexp(lf[:, s:s + tile], -1) for s in range(0, vocab, tile)], -1)
parts_empty = torch.cat([parts, torch.full((rows, 1), -float("inf"))], -1)
lse = torch.logsumexp(parts, -1)  # (what quack's host fold returned)
tgt_logit = lf.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
da_r, zdz_r = ce_grad_math(logits, lse, tgt_logit, targets, rstd)
p = torch.exp(lf - lse[:, None])
onehot = torch.arange(vocab)[None, :] == targets[:, None]
valid = targets != ref.IGNORE_INDEX
r = torch.where(valid, rstd, 0.0)
da_f = (p - onehot.float()) * r[:, None]  # (before the bf16 rounding)
loss_r = torch.where(valid, lse - tgt_logit, 0.0)
# lse from n partials in another fold: exp's and log's roundings (1 unit each), the n - 1 additions of the sum
# (at most n units of it, relative, so n absolute in its log) and the final addition: n + 3 units plus 2 units
# of |lse| and of the max
n = parts_empty.shape[1]
lse_bound = (n + 3) * U + 2 * U * (lse.abs() + parts.amax(-1).abs())
got = {}
for name, given in (("parts", parts_empty), ("lse", lse[:, None])):
    buf, loss_rows = logits.clone(), torch.full((rows,), float("nan"))
    da, corr = ce_pass.ce_grad_inplace(buf, given, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, loss_rows)
    lse_k = torch.where(valid, loss_rows + tgt_logit, lse)  # (the kernel's lse, read back through its loss term)
    dl = (lse_k - lse).abs()
    # da: one bf16 rounding of a value (within 2^-7 of it, either direction) whose p = exp(l - lse) is off by
    # exp's 4 units and the kernel's lse error dl (relative, in p), times r
    bound = 2.0**-7 * da_f.abs() + (4 * U + dl[:, None]) * p * r[:, None]
    # corr = -(r^2 / d) zdz: zdz in another order (2 (V - 1) units of the sum of |terms|), and its terms' p off
    # by dl; then two roundings of the product
    zb = (2 * (vocab - 1) * U + dl) * (p * lf).abs().sum(-1)
    corr_r = -(rstd * rstd * torch.tensor(1.0 / d, dtype=torch.float32)) * zdz_r
    got[name] = {
        "in_place": da.data_ptr() == buf.data_ptr(), "da_dtype": str(da.dtype),
        "lse_err_over_bound": float((dl / lse_bound)[valid].max()),
        "loss_err_over_bound": float(((loss_rows - loss_r).abs() / (lse_bound + U * loss_r.abs())).max()),
        "ignored_loss_zero": float(loss_rows[1]) == 0.0,
        "da_err_over_bound": float(((da.float() - da_f).abs() / bound.clamp(min=1e-30)).max()),
        "ignored_row_zero": bool((da[1] == 0).all()) and float(corr[1]) == 0.0,
        "corr_err_over_bound": float(((corr - corr_r).abs() / (rstd * rstd / d * zb + 2 * U * corr_r.abs() + 1e-30)).max()),
    }

# the fp8 head's pass: the codes of da * inv. The interpreter's own fp32 -> e5m2 rounding (which is not the GPU's:
# it can drop a rounding carry a binade, 127.8 -> 64) is applied to the reference values at the ends of their error
# interval (p off by exp's 4 units and the lse error, as above): each code is one of those; zdz within corr's zdz
# bound
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _cast(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N)
    tl.store(y_ptr + i, tl.clamp(x, -57344.0, 57344.0).to(tl.float8e5, fp_downcast_rounding="rtne"), mask=i < N)


def interp_e5m2(v):
    out = torch.empty(v.shape, dtype=torch.float8_e5m2)
    _cast[(triton.cdiv(v.numel(), 1024),)](v.contiguous(), out, v.numel(), BLOCK=1024)
    return out.float()


inv = torch.tensor(2.0 ** 14)
buf, loss_rows = logits.clone(), torch.full((rows,), float("nan"))
daq, zdz = ce_pass.ce_grad_e5m2(buf, parts, tgt_logit, targets, rstd, inv, ref.IGNORE_INDEX, loss_rows)
lse_k = torch.where(valid, loss_rows + tgt_logit, lse)
dl = (lse_k - lse).abs()
v, err = da_f * inv, (4 * U + dl[:, None]) * p * r[:, None] * inv
ends = [interp_e5m2(v - err), interp_e5m2(v), interp_e5m2(v + err)]
got["fp8"] = {
    "logits_kept": torch.equal(buf, logits), "daq_dtype": str(daq.dtype), "daq_shape": list(daq.shape),
    "codes_outside": int((~((daq.float() == ends[0]) | (daq.float() == ends[1]) | (daq.float() == ends[2]))).sum()),
    "codes_moved": int((daq.float() != ends[1]).sum()),
    "zdz_err_over_bound": float(((zdz - zdz_r).abs() / ((2 * (vocab - 1) * U + dl) * (p * lf).abs().sum(-1) + 1e-30))
                                .max()),
    "ignored_row_zero": bool((daq[1].float() == 0).all()) and float(zdz[1]) == 0.0,
}

# both at once (``codes_inv``): the in-place pass's da and corr and ``ce_grad_e5m2``'s codes, bit for bit
buf2, loss2 = logits.clone(), torch.full((rows,), float("nan"))
da2, corr2, daq2 = ce_pass.ce_grad_inplace(buf2, parts, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, loss2,
                                           codes_inv=inv)
da1, corr1 = ce_pass.ce_grad_inplace(logits.clone(), parts, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d)
got["both"] = {
    "in_place": da2.data_ptr() == buf2.data_ptr(), "da_same": bool(torch.equal(da2, da1)),
    "corr_same": bool(torch.equal(corr2, corr1)), "loss_same": bool(torch.equal(loss2, loss_rows)),
    "codes_same": bool(torch.equal(daq2.view(torch.uint8), daq.view(torch.uint8))),
    "refuses_tdelta": refuses(lambda: ce_pass.ce_grad_inplace(logits.clone(), parts, tgt_logit, targets, rstd,
                                                               ref.IGNORE_INDEX, d, tdelta=torch.zeros(rows),
                                                               codes_inv=inv), says="tdelta"),
}

# stochastically rounded codes (``sr_seed``, ``fp8_lm_head_dw``): for fixed random bits the rounding is monotone in
# the value, so each code lies between ``scaling.quantize_e5m2_sr``'s codes of the ends of the value's error
# interval with the same seed and counters (the rows counted from row0). The codes are exact in e5m2 from 2^-14
# up; below it the interpreter's own fp32 -> e5m2 rounding takes them (not the GPU's), so there a code may be one
# subnormal step (2^-16) past those ends. The same seed repeats the codes, another draws others; the bf16 da and
# corr are the in-place pass's, bit for bit
seed, row0 = 17, 3
offs = (torch.arange(rows)[:, None] + row0) * vocab + torch.arange(vocab)
normal = v.abs() >= 2.0 ** -14  # (unbiased: the codes' mean error, in steps 2^(e - 2) of each value's binade e)
step_v = 2.0 ** (torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -14))) - 2)
slack = torch.where(v.abs() + err < 2.0 ** -14, 2.0 ** -16, 0.0)
lo_sr, hi_sr = (scaling.quantize_e5m2_sr(w / inv, inv, seed, offs).float() for w in (v - err, v + err))
sr_pass = functools.partial(ce_pass.ce_grad_inplace, lse_parts=parts, tgt_logit=tgt_logit, targets=targets,
                            rstd=rstd, ignore_index=ref.IGNORE_INDEX, dim=d, codes_inv=inv, row0=row0)
da3, corr3, daq3 = sr_pass(logits.clone(), sr_seed=seed)
q3 = daq3.float()
again, other = (sr_pass(logits.clone(), sr_seed=s_)[2] for s_ in (seed, seed + 1))
got["sr"] = {
    "mean_err_steps": float(((q3 - v) / step_v)[normal].double().mean()),
    "codes_outside": int(((q3 < lo_sr - slack) | (q3 > hi_sr + slack)).sum()),
    "codes_normal": int(normal.sum()),
    "codes_off_nearest": int((q3 != ends[1]).sum()),
    "repeats": bool(torch.equal(again.view(torch.uint8), daq3.view(torch.uint8))),
    "other_seed_moves": int((other.view(torch.uint8) != daq3.view(torch.uint8)).sum()),
    "da_same": bool(torch.equal(da3, da1)), "corr_same": bool(torch.equal(corr3, corr1)),
}
got["sr"]["refuses_without_codes"] = refuses(lambda: ce_pass.ce_grad_inplace(
    logits.clone(), parts, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, sr_seed=seed), says="sr_seed")
# the codes alone (``ce_grad_e5m2`` with ``sr_seed``: ``fp8_lm_head_dgrad``, no bf16 da): the same codes, the
# logits left as they are
buf5 = logits.clone()
daq5, _ = ce_pass.ce_grad_e5m2(buf5, parts, tgt_logit, targets, rstd, inv, ref.IGNORE_INDEX, sr_seed=seed, row0=row0)
got["sr"]["codes_only_same"] = bool(torch.equal(daq5.view(torch.uint8), daq3.view(torch.uint8)))
got["sr"]["codes_only_logits_kept"] = bool(torch.equal(buf5, logits))
# ``target_da`` (``fp8_lm_head_dgrad``'s B2 term) into a given buffer: the same codes there, and in zdz's place each
# row's unrounded fp32 da at its target, within p's error (exp's 4 units and the lse error) plus one unit; 0 ignored
out6 = torch.empty((rows, vocab), dtype=scaling.E5M2)
daq6, da_t = ce_pass.ce_grad_e5m2(logits.clone(), parts, tgt_logit, targets, rstd, inv, ref.IGNORE_INDEX,
                                  sr_seed=seed, row0=row0, target_da=True, out=out6)
ti = targets.clamp(min=0)[:, None]
want_t = torch.where(valid, da_f.gather(1, ti).squeeze(1), 0.0)
bound_t = ((4 * U + dl[:, None]) * p * r[:, None]).gather(1, ti).squeeze(1) + U * want_t.abs()
got["sr"]["target_da_codes_same"] = bool(torch.equal(daq6.view(torch.uint8), daq3.view(torch.uint8)))
got["sr"]["target_da_in_out"] = daq6.data_ptr() == out6.data_ptr()
got["sr"]["target_da_err_over_bound"] = float(((da_t - want_t).abs() / bound_t.clamp(min=1e-30)).max())
got["sr"]["target_da_ignored_zero"] = float(da_t[1]) == 0.0 and da_t.dtype == torch.float32
got["sr"]["target_da_refuses_short_out"] = refuses(lambda: ce_pass.ce_grad_e5m2(
    logits.clone(), parts, tgt_logit, targets, rstd, inv, ref.IGNORE_INDEX, target_da=True,
    out=torch.empty((rows - 1, vocab), dtype=scaling.E5M2)), says="out must be")

# the token-major codes pass (``ce_codes_t``, CODA_TITAN_CE_CODES_T=1): two row blocks (the second ragged), three
# column ranges, 200 partials (two fold blocks). Its lse, loss, da and corr are the row pass's arithmetic in
# another order: within the bounds above with its own lse error; its codes, in a wider buffer at column col0, lie
# between the quantizer's codes of the ends of each value's error interval (each rounding mode), the columns
# around them untouched
codes_t = cute_module("ce_codes_t")
fine = torch.stack([torch.logsumexp(lf[:, s:s + 25], -1) for s in range(0, vocab, 25)], -1)
lse_bound_f = (fine.shape[1] + 3) * U + 2 * U * (lse.abs() + fine.amax(-1).abs())
col0, width = 2, rows + 5
corr_r = -(rstd * rstd * torch.tensor(1.0 / d, dtype=torch.float32)) * zdz_r
got["codes_t"] = {}
for mode in ("nearest", "stochastic"):
    buf4, loss4 = logits.clone(), torch.full((rows,), float("nan"))
    daq_t = torch.full((vocab, width), 0x3C, dtype=torch.uint8).view(torch.float8_e5m2)
    da4, corr4 = codes_t.ce_grad_codes_t(buf4, fine, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, loss4, inv,
                                         daq_t, col0, None if mode == "nearest" else seed, row0, rb=4, bv=256,
                                         nsplit=3, num_warps=4)
    lse4 = torch.where(valid, loss4 + tgt_logit, lse)
    dl4 = (lse4 - lse).abs()
    err4 = (4 * U + dl4[:, None]) * p * r[:, None] * inv
    q4 = daq_t[:, col0:col0 + rows].t().float()
    if mode == "nearest":  # (the interpreter's rounding is not monotone: one of the three, as the fp8 pass's)
        e4 = [interp_e5m2(v - err4), interp_e5m2(v), interp_e5m2(v + err4)]
        outside = ~((q4 == e4[0]) | (q4 == e4[1]) | (q4 == e4[2]))
    else:
        lo4, hi4 = (scaling.quantize_e5m2_sr(w / inv, inv, seed, offs).float() for w in (v - err4, v + err4))
        outside = (q4 < lo4 - slack) | (q4 > hi4 + slack)
    zb4 = (2 * (vocab - 1) * U + dl4) * (p * lf).abs().sum(-1)
    got["codes_t"][mode] = {
        "in_place": da4.data_ptr() == buf4.data_ptr(),
        "lse_err_over_bound": float((dl4 / lse_bound_f)[valid].max()),
        "da_err_over_bound": float(((da4.float() - da_f).abs() / (2.0**-7 * da_f.abs() + (4 * U + dl4[:, None]) * p
                                                                    * r[:, None]).clamp(min=1e-30)).max()),
        "corr_err_over_bound": float(((corr4 - corr_r).abs() / (rstd * rstd / d * zb4 + 2 * U * corr_r.abs()
                                                                + 1e-30)).max()),
        "codes_outside": int(outside.sum()),
        "codes_off_nearest": int((q4 != ends[1]).sum()),
        "others_untouched": bool((daq_t.view(torch.uint8)[:, :col0] == 0x3C).all()
                                 and (daq_t.view(torch.uint8)[:, col0 + rows:] == 0x3C).all()),
        "ignored": bool((da4[1] == 0).all()) and float(corr4[1]) == 0.0 and float(loss4[1]) == 0.0,
    }
got["codes_t"]["refuses_short_buffer"] = refuses(lambda: codes_t.ce_grad_codes_t(
    logits.clone(), fine, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, torch.zeros(rows), inv,
    torch.zeros((vocab, rows), dtype=torch.float8_e5m2), col0), says="daq_t")

# the consistent zdz (``tdelta`` given): sum_n l_n da_n / r over the stored logits and the da the pass wrote, read
# back from the buffer (whatever rounding the interpreter applied), the target's term on l_t + tdelta; in another
# summation order: 2 V units of the sum of its terms' magnitudes, then the division and corr's two roundings
buf = logits.clone()
tdelta = (torch.rand(rows) - 0.5) * 0.02
da, corr = ce_pass.ce_grad_inplace(buf, parts, tgt_logit, targets, rstd, ref.IGNORE_INDEX, d, tdelta=tdelta)
daf = da.float()
dat = daf.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
zdz_c = torch.where(valid, ((lf * daf).sum(-1) + tdelta * dat) / rstd, 0.0)
corr_c = -(rstd * rstd * torch.tensor(1.0 / d, dtype=torch.float32)) * zdz_c
zb = (2 * vocab * U * ((lf * daf).abs().sum(-1) + (tdelta * dat).abs()) / rstd + 2 * U * zdz_c.abs())
got["consistent"] = {
    "da_same": bool(torch.equal(da, ce_pass.ce_grad_inplace(logits.clone(), parts, tgt_logit, targets, rstd,
                                                             ref.IGNORE_INDEX, d)[0])),
    "corr_err_over_bound": float(((corr - corr_c).abs() / (rstd * rstd / d * zb + 2 * U * corr_c.abs() + 1e-30)).max()),
    "ignored_row_zero": float(corr[1]) == 0.0,
    # (and it is another value than the pass's usual zdz: the inconsistency it removes, relative)
    "differs_from_plain": float(((corr - corr_r).abs() / corr_r.abs().clamp(min=1e-30))[valid].max()),
}

got["refusals"] = {
    "parts_rows": refuses(ce_pass.ce_grad_inplace, logits.clone(), parts[:2], tgt_logit, targets, rstd,
                          ref.IGNORE_INDEX, d, says="log-sum-exp partials"),
    "loss_dtype": refuses(ce_pass.ce_grad_inplace, logits.clone(), parts, tgt_logit, targets, rstd,
                          ref.IGNORE_INDEX, d, torch.zeros(rows, dtype=torch.float64), says="loss_rows"),
}
print(json.dumps(got))
