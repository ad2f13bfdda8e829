"""F4 lm_head_ce: backward (gradcheck, fp64), equality with the full-logits cross-entropy for every chunk
size, the op (with and without gradients), and the cute kernel against the reference (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels.lm_head_ce import IGNORE_INDEX
from coda_titan.model.autograd import LMHeadCE

from .helpers import CFG, D, DIMS, EPS, M, V, check_cute_matches_reference, deferred_norm, op_cases, rand64


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
