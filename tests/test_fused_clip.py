"""``[coda] fused_clip`` (coda_titan/titan/fused_clip.py): TorchTitan's clip folded into the fused AdamW
step, against TorchTitan's clip followed by the same step, on the CPU (torch's fused AdamW runs there).

Where the coefficient is 1 nothing is rounded differently, so the two must agree bit for bit. Where it
clips, TorchTitan's step reads g' = rnd(g * c) (one rounding in the gradient's dtype) and the fused step
g / s with s = fp32(1 / c) (c and 1 / c each rounded once in fp32, the division once more): the
gradients the steps read differ by at most 4 units of the gradient dtype's roundoff u, relative to g'.
After one AdamW step from a zero state, the update lr * g / (|g| + eps) moves by at most
lr * eps |dg| / (|g| + eps)^2 <= lr * 4u / 4 (the maximum of eps |g| / (|g| + eps)^2 over |g| is 1/4),
each run's update carries its own roundings (m, v, the square root, the division, the product by lr:
4u relative each, lr * 8u for the two), and each run rounds the new parameter once, so the two may land
one unit in the last place apart (2u |p|): bound 2u |p| + 9 lr u on each parameter.
"""

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils

from coda_titan.titan import fused_clip

from .helpers import optimizer_check_refuses

LR = 1e-2


def _model(dtype, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device, dtype)


def _grads(model, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.device, p.dtype)


def _container(model):
    return OptimizersContainer([model], torch.optim.AdamW, {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8,
                                                            "weight_decay": 0.1, "fused": True})


@pytest.fixture
def restore_clip():
    original = dist_utils.clip_grad_norm_
    yield
    dist_utils.clip_grad_norm_ = original
    fused_clip._ACTIVE, fused_clip._ORIGINAL = None, None


def _run(dtype, max_norm, steps, fused: bool, device="cpu"):
    """``steps`` steps of TorchTitan's clip + optimizer step (fused or not) on the same gradients:
    (parameters, gradients after the last step, the norms the clip returned)."""
    model = _model(dtype, device=device)
    opts = _container(model)
    if fused:
        fused_clip.install(opts, [model])
    norms = []
    for step in range(steps):
        _grads(model, 0.5, seed=step)
        params = [p for p in model.parameters()]
        norms.append(dist_utils.clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=None, ep_enabled=False))
        opts.step()
    return [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()], norms


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _needs(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_clipping_the_fused_step_is_the_same_bits(dtype, device, restore_clip):
    _needs(device)
    want = _run(dtype, 1e6, 3, fused=False, device=device)
    got = _run(dtype, 1e6, 3, fused=True, device=device)
    for w, g in zip(want[0] + want[1] + want[2], got[0] + got[1] + got[2]):
        assert torch.equal(w, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_clipping_the_fused_step_is_within_a_rounding(dtype, device, restore_clip):
    _needs(device)
    want_p, want_g, want_n = _run(dtype, 0.25, 1, fused=False, device=device)
    got_p, got_g, got_n = _run(dtype, 0.25, 1, fused=True, device=device)
    assert torch.equal(want_n[0], got_n[0]) and want_n[0] > 1.0  # (the norm is TorchTitan's; it clips)
    u = torch.finfo(dtype).eps / 2
    for w, g in zip(want_g, got_g):  # the clipped gradients the two steps read (written back by both)
        assert ((g.double() - w.double()).abs() <= 4 * u * w.double().abs()).all()
    for w, g in zip(want_p, got_p):
        bound = 2 * u * w.double().abs() + 9 * LR * u
        err = (g.double() - w.double()).abs()
        assert (err <= bound).all(), f"max {err.max().item():.3e} vs bound {bound.min().item():.3e}"


def test_the_wrapper_serves_only_the_installed_parameters(restore_clip):
    model, other = _model(torch.float32), _model(torch.float32, seed=1)
    opts = _container(model)
    active = fused_clip.install(opts, [model])
    _grads(model, 0.5, seed=0)
    before = [p.grad.clone() for p in model.parameters()]
    dist_utils.clip_grad_norm_(list(model.parameters()), 0.25, foreach=True)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))  # no multiply pass
    assert active.scale is not None and active.scale.dtype == torch.float32 and active.scale > 1
    opts.step()
    assert active.scale is None and all("grad_scale" not in o.__dict__ for o in opts.optimizers)
    _grads(other, 0.5, seed=0)
    before = [p.grad.clone() for p in other.parameters()]
    dist_utils.clip_grad_norm_(list(other.parameters()), 0.25, foreach=True)  # not ours: TorchTitan's clip
    assert all(not torch.equal(b, p.grad) for b, p in zip(before, other.parameters()))
    assert active.scale is None


def test_install_refuses_a_non_fused_optimizer(restore_clip):
    model = _model(torch.float32)
    opts = OptimizersContainer([model], torch.optim.AdamW, {"lr": LR, "foreach": True})
    with pytest.raises(ValueError, match="fused Adam"):
        fused_clip.install(opts, [model])


@pytest.mark.parametrize("change, needs", [
    ({"world_size": 2}, "a single device"),
    ({"implementation": "foreach"}, 'implementation = "fused"'),
    ({"name": "SGD"}, 'name = "AdamW"'),
    ({"early_step_in_backward": True}, "early_step_in_backward = false"),
])
def test_the_config_check_names_what_is_missing(change, needs):
    optimizer_check_refuses(fused_clip.check, "fused_clip", change, needs)
