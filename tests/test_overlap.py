"""Overlapped pingpong epilogues (``coda_titan/kernels/cute/overlap.py``) on programs with a D output:
quack's F1 (``rms_partial_epi``) and B2 (``rms_bwd_apply_epi``) epilogues, as CODA calls them, on one
pinned pingpong config with and without overlap. Each element's math, each tile's reductions and
each store are the plain kernel's, so every output must be its bits; D's ring halved wrongly, or a
buffer, ring slot or barrier the two warpgroups shared, would show as other bits or a hang. (B3 with
transposed outputs, which has no D: ``tests/test_norm_swiglu.py``.) GPU only."""

from __future__ import annotations

import pytest
import torch

BF = torch.bfloat16


def _configs():
    from quack.gemm_config import GemmConfig

    # two objects: quack's eager call cache keys a pinned config by its id
    return [GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2, is_dynamic_persistent=False,
                       device_capacity=9) for _ in range(2)]


def _f1(cfg, gen_seed=0, m=4096, k=2048, d=2048):
    from quack.epilogue.library import rms_partial_epi

    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    y = torch.randn(m, k, generator=g, device="cuda").to(BF)
    w = (torch.randn(d, k, generator=g, device="cuda") * k**-0.5).to(BF)
    res = torch.randn(m, d, generator=g, device="cuda").to(BF)
    gamma = 1 + 0.1 * torch.randn(d, generator=g, device="cuda")
    out = {"D": torch.empty_like(res), "resid_out": torch.empty_like(res)}
    r = rms_partial_epi(y, w.t(), res, out=out, tuned=False, config=cfg, weight=gamma)
    return [out["D"], out["resid_out"], r["sqsum"]]


def _b2(cfg, gen_seed=0, m=4096, k=3072, d=2048):
    from quack.epilogue.library import rms_bwd_apply_epi

    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    da = (torch.randn(m, k, generator=g, device="cuda") * 1e-2).to(BF)
    w = (torch.randn(k, d, generator=g, device="cuda") * k**-0.5).to(BF)
    x = torch.randn(m, d, generator=g, device="cuda").to(BF)
    dres = (torch.randn(m, d, generator=g, device="cuda") * 1e-2).to(BF)
    gamma = 1 + 0.1 * torch.randn(d, generator=g, device="cuda")
    corr = torch.randn(m, generator=g, device="cuda") * 1e-3
    out = {"D": torch.empty_like(x)}
    r = rms_bwd_apply_epi(da, w, dres, out=out, tuned=False, config=cfg, y=x, w=gamma, corr=corr)
    return [out["D"], r["dw"]]


@pytest.mark.gpu
@pytest.mark.parametrize("program", ["f1", "b2"])
def test_programs_with_a_d_output_and_overlapped_epilogues_write_the_same_bits(program):
    from coda_titan.kernels.cute import overlap

    run = {"f1": _f1, "b2": _b2}[program]
    plain_cfg, overlap_cfg = _configs()
    want = run(plain_cfg)
    with overlap.requested():
        got = run(overlap_cfg)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
