"""F4 lm_head_ce: backward (gradcheck, fp64), equality with the full-logits cross-entropy for every chunk
size, the op (with and without gradients), and the cute kernel against the reference (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels.lm_head_ce import IGNORE_INDEX
from coda_titan.model.autograd import LMHeadCE

from .helpers import CFG, D, DIMS, EPS, M, V, check_cute_matches_reference, deferred_norm, op_cases, rand64, run_interpreter_check


def test_lm_head_ce_backward():
    x, gamma, w = rand64(M, D), rand64(D), rand64(V, D, scale=0.5)
    targets = torch.randint(0, V, (M,))
    targets[2] = IGNORE_INDEX

    def f(x, gamma, w):
        h, r = deferred_norm(x, gamma)
        return LMHeadCE.apply(h, r, x, gamma, w, targets, CFG, True)

    assert torch.autograd.gradcheck(f, (x, gamma, w))


def test_lm_head_ce_matches_full_logits_and_chunking():
    x, gamma, w = rand64(M, D), rand64(D), rand64(V, D)
    targets = torch.randint(0, V, (M,))
    targets[:3] = IGNORE_INDEX
    h, r = deferred_norm(x, gamma)
    logits = torch.nn.functional.rms_norm(x, (D,), gamma, EPS) @ w.t()
    ref = torch.nn.functional.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    for rows in (1, 3, M, 4 * M):
        loss, *_ = CFG.backend.lm_head_ce(h=h, rstd=r, x=x, gamma=gamma, weight=w, targets=targets, chunk_rows=rows)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['lm_head_ce'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


def test_opcheck_loss_only():
    args = list(op_cases(torch.float32)["lm_head_ce"])
    args[-1] = False
    opcheck(torch.ops.coda.lm_head_ce.default, tuple(args))


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['lm_head_ce'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["one_chunk", "inductor"])
def test_cute_lm_head_ce_arms_match_reference(arm, monkeypatch):
    """The paths ``test_cute_matches_reference`` (several chunks, the in-place Triton pass, the last
    chunk's dW GEMM writing bf16) leaves out: one chunk (dW's GEMM straight to bf16, no fp32 sum), and
    the previous program (``CODA_TITAN_CE_PASS=inductor``: the inductor pass, dW in fp32, then a cast)."""
    if arm == "inductor":
        monkeypatch.setenv("CODA_TITAN_CE_PASS", "inductor")
    check_cute_matches_reference("lm_head_ce", 2048, **({"chunk_rows": 1 << 20} if arm == "one_chunk" else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["ragged", "three_chunks", "one_chunk"])
def test_cute_lm_head_ce_scaled_exp_matches_reference(arm, monkeypatch):
    """``CODA_TITAN_CE_PASS=scaled_exp`` (no pass over the logits: E with per-tile offsets, the glue, strip-scaled
    dX and dW GEMMs) against the reference, under the same derived bound. ``ragged``: the default inputs
    (2000 rows, vocabulary 16384: n-tiles of 256), two scaled-exp chunks of 768 rows, the ragged last one on
    the Triton pass adding to their fp32 dW. On 1920 rows and a vocabulary of 16128 (n-tiles of 192, as the
    1B's 128256): ``three_chunks`` of 640 (dW stored, reduce-added, then the last chunk's GEMM adding the sum
    as C in bf16), ``one_chunk`` (dW's GEMM straight to bf16)."""
    monkeypatch.setenv("CODA_TITAN_CE_PASS", "scaled_exp")
    if arm == "ragged":
        check_cute_matches_reference("lm_head_ce", 2048)
        return
    gen = torch.Generator(device="cuda").manual_seed(19)
    rows, vocab, d = 1920, 16128, 2048

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    targets = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    targets[::7] = IGNORE_INDEX
    check_cute_matches_reference(
        "lm_head_ce", d, h=r(rows, d), rstd=torch.rand(rows, generator=gen, device="cuda") + 0.5, x=r(rows, d),
        weight=r(vocab, d, scale=d**-0.5), targets=targets, chunk_rows=640 if arm == "three_chunks" else 1 << 20)


def test_scaled_exp_glue_in_the_interpreter():
    """F4's scaled-exp glue (``kernels/cute/lce_glue.py``) run by Triton's CPU interpreter
    (``tests/lce_glue_interpreter_check.py``) on the first GEMM's outputs emulated in fp32 (integer offsets per
    n-tile, bf16 E, fp32 partial sums; a row with a tile 30 logit units below its maximum; targets in the
    first and last column of a tile, the last column, ignored). Against the glue's formulas in fp64: loss,
    r v and corr within (tiles + 8) fp32 units of their magnitudes (a sum over tiles, a log, a few products);
    the strip exactly 2^(k_t - k_row). Against the cross-entropy in fp64: da rebuilt as the GEMMs see it,
    r v u E, within one bf16 step (2^-7, E's rounding; the interpreter truncates) plus those units; zdz within
    (V + tiles + 8) units of sum |z p|; xs = r v h within one bf16 step; an ignored row all zero; E changed at
    the targets only."""
    got = run_interpreter_check("lce_glue_interpreter_check.py")
    assert got["strip_exact"] and got["ignored_row"] and got["changed_only_targets"], got
    for name in ("loss", "rv", "corr", "da", "zdz", "xs"):
        assert got[f"{name}_err_over_bound"] <= 1.0, (name, got)


def test_ce_triton_pass_is_the_inductor_programs_arithmetic_in_the_interpreter():
    """F4's in-place gradient pass (``kernels/cute/ce_grad_pass.py``) run by Triton's CPU interpreter
    (``tests/ce_interpreter_check.py``, a subprocess: TRITON_INTERPRET is read at import) against the
    fp32 arithmetic of the inductor program it replaces, on rows of two column blocks (the second one
    masked), targets in either block, at the last column and ignored. da is written over the logits
    buffer; each element is within one bf16 step of the fp32 value (the interpreter truncates, the GPU
    rounds to nearest: the GPU tests) plus 4 fp32 units for exp's own rounding; an ignored row is all
    zero with zdz 0; zdz differs only by the row sum's order: at most 2 (V - 1) fp32 units of the sum of
    its terms' magnitudes."""
    got = run_interpreter_check("ce_interpreter_check.py")
    assert got["in_place"] and got["da_dtype"] == "torch.bfloat16", got
    assert got["da_err_over_bound"] <= 1.0 and got["ignored_row_zero"], got
    assert got["zdz_err_over_bound"] <= 1.0, got
