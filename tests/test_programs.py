"""Each reference program's backward (the CODA backward programs) against torch.autograd.gradcheck.

The producer writes H = X * gamma and the partial sums S as non-differentiable values; the consumer's
backward accounts for them through zdz. So each check differentiates the composite that a user sees:
producer epilogue (no grad) + finalize + consumer program, as functions of X, gamma and the weights.
Shapes are odd on purpose: d = 24 with tile 16 (ragged last tile), GQA (4 q heads, 2 kv heads),
rows = 2 sequences of 5.
"""

import pytest
import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels.lm_head_ce import IGNORE_INDEX
from coda_titan.model.autograd import LMHeadCE, NormRoPE, NormSwiGLUResidual, ProgramConfig, ResidualRMS
from coda_titan.model.rope import rope_freqs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

BS, SEQ, D, FF, V = 2, 5, 24, 10, 13
HQ, HKV, HD = 4, 2, 6
EPS = 1e-5
CFG = ProgramConfig(backend=get_backend("torch"), tile_n=16, eps=EPS, ce_chunk_rows=3)
M = BS * SEQ


def _rand(*shape, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()


def _deferred_norm(x, gamma):
    """What the producer epilogue and finalize hand the consumer: H, r (no autograd)."""
    with torch.no_grad():
        h, s = CFG.backend.rms_partial(x=x, gamma=gamma, tile_n=CFG.tile_n)
        r = CFG.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=EPS)
    return h, r


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_residual_rms_backward():
    y, w, res, gamma = _rand(M, 7), _rand(D, 7), _rand(M, D), _rand(D)

    def f(y, w, res):
        return ResidualRMS.apply(y, w, res, gamma, CFG)[0]

    assert torch.autograd.gradcheck(f, (y, w, res))


def test_residual_rms_outputs():
    y, w, res, gamma = _rand(M, 7), _rand(D, 7), _rand(M, D), _rand(D)
    x, h, s = ResidualRMS.apply(y, w, res, gamma, CFG)
    ref = y @ w.t() + res
    torch.testing.assert_close(x, ref)
    torch.testing.assert_close(h, ref * gamma)
    torch.testing.assert_close(s.sum(-1), (ref * ref).sum(-1))
    assert s.shape == (M, 2)  # ceil(24 / 16) tiles
    assert not h.requires_grad and not s.requires_grad


def test_norm_rope_backward():
    freqs = rope_freqs(HD, 10000.0, RoPEScalingArgs())
    x, gamma = _rand(M, D), _rand(D)
    wq, wk, wv = _rand(HQ * HD, D), _rand(HKV * HD, D), _rand(HKV * HD, D)

    def f(x, gamma, wq, wk, wv):
        h, r = _deferred_norm(x, gamma)
        return NormRoPE.apply(h, r, x, gamma, wq, wk, wv, freqs, SEQ, CFG, HQ + HKV, HD)

    assert torch.autograd.gradcheck(f, (x, gamma, wq, wk, wv))


def test_norm_swiglu_residual_backward():
    x, gamma, gamma_next = _rand(M, D), _rand(D), _rand(D)
    w1, w3, w2 = _rand(FF, D), _rand(FF, D), _rand(D, FF)

    def f(x, gamma, w1, w3, w2):
        h, r = _deferred_norm(x, gamma)
        return NormSwiGLUResidual.apply(h, r, x, gamma, w1, w3, w2, gamma_next, CFG)[0]

    assert torch.autograd.gradcheck(f, (x, gamma, w1, w3, w2))


def test_lm_head_ce_backward():
    x, gamma, w = _rand(M, D), _rand(D), _rand(V, D, scale=0.5)
    targets = torch.randint(0, V, (M,))
    targets[2] = IGNORE_INDEX

    def f(x, gamma, w):
        h, r = _deferred_norm(x, gamma)
        return LMHeadCE.apply(h, r, x, gamma, w, targets, CFG, True)

    assert torch.autograd.gradcheck(f, (x, gamma, w))


def test_lm_head_ce_matches_full_logits_and_chunking():
    x, gamma, w = _rand(M, D), _rand(D), _rand(V, D)
    targets = torch.randint(0, V, (M,))
    targets[:3] = IGNORE_INDEX
    h, r = _deferred_norm(x, gamma)
    logits = torch.nn.functional.rms_norm(x, (D,), gamma, EPS) @ w.t()
    ref = torch.nn.functional.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    for rows in (1, 3, M, 4 * M):
        loss, *_ = CFG.backend.lm_head_ce(h=h, rstd=r, x=x, gamma=gamma, weight=w, targets=targets, chunk_rows=rows)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)


def test_rope_bwd_zdz_is_invariant():
    """zdz from post-RoPE values equals sum p * dp from pre-RoPE values (R is orthogonal)."""
    freqs = rope_freqs(HD, 500000.0, RoPEScalingArgs())
    rope = dict(freqs=freqs, seqlen=SEQ, n_rope_heads=HQ + HKV, head_dim=HD)
    h, r = _deferred_norm(torch.randn(M, D, dtype=torch.float64), torch.randn(D, dtype=torch.float64))
    w = torch.randn((HQ + 2 * HKV) * HD, D, dtype=torch.float64)
    y = CFG.backend.norm_rope(h=h, rstd=r, weight=w, **rope)
    dy = torch.randn_like(y)
    da, zdz = CFG.backend.rope_bwd(dy=dy, y=y, rstd=r, **rope)
    p = (h @ w.t()) * r[:, None]
    dp = da / r[:, None]
    torch.testing.assert_close(zdz, (p * dp).sum(-1), rtol=1e-12, atol=1e-12)
    v0 = (HQ + HKV) * HD
    torch.testing.assert_close(y[:, v0:], p[:, v0:])  # v is not rotated
