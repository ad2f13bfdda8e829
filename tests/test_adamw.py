"""``[coda] coda_adamw`` (coda_titan/titan/coda_adamw.py, coda_titan/kernels/adamw.py): torch's fused AdamW step
in one Triton launch.

The claim is the same bits as torch's fused AdamW: the kernel computes torch's fused functor's fp32 arithmetic in
the same order (no derived bound: any element apart is a bug). On the GPU the kernel's tensors are checked against
``torch.optim.AdamW(fused=True)`` after steps with and without a ``grad_scale``, bf16 and fp32, beside tensors the
kernel leaves to torch (an element count not a multiple of 8). On the CPU every tensor takes torch's fused kernel
(off CUDA), so there the class, its state, its ``state_dict``, the fallback and the checks are tested bit for bit.
"""

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer

from coda_titan.kernels import adamw as kernel
from coda_titan.titan import coda_adamw

from .helpers import optimizer_check_refuses, run_interpreter_check

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}
SHAPES = [(96, 64), (64,), (1000, 8), (13,), (3, 5)]  # (the last two: element counts the kernel leaves to torch)


def _params(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(device, dtype)) for s in SHAPES]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device, p.dtype)


def _run(dtype, device, coda: bool, steps=4):
    """Steps 0 and 2 with a grad_scale of 1.25 (as ``fused_clip`` sets it), 1 and 3 without: (params, grads, state)."""
    params = _params(dtype, device)
    opt = torch.optim.AdamW(params, **HYPER)
    if coda:
        coda_adamw.install(opt)
    for step in range(steps):
        _grads(params, step)
        if step % 2 == 0:
            opt.grad_scale = torch.tensor(1.25, device=device)
        opt.step()
        opt.__dict__.pop("grad_scale", None)
    return params, opt


def _bits_equal(a, b):
    same = a.dtype == b.dtype and a.shape == b.shape
    return same and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _same_steps(dtype, device):
    want_p, want = _run(dtype, device, coda=False)
    got_p, got = _run(dtype, device, coda=True)
    assert type(got) is coda_adamw.CodaAdamW
    for w, g in zip(want_p, got_p):
        assert _bits_equal(w.detach(), g.detach()) and _bits_equal(w.grad, g.grad)
        sw, sg = want.state[w], got.state[g]
        assert sorted(sw) == sorted(sg) == ["exp_avg", "exp_avg_sq", "step"]
        for k in sw:
            assert _bits_equal(sw[k], sg[k]), k
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_every_tensor_steps_through_torch_and_nothing_changes(dtype, caplog):
    got = _same_steps(dtype, "cpu")
    assert got.__dict__.get("_coda_said")  # (the fallback said so once)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_torch_fused_adamw_bit_for_bit(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got = _same_steps(dtype, "cuda")
    ours = [p for p in got.param_groups[0]["params"] if kernel.supported(p, p.grad, *(got.state[p][k] for k in (
        "exp_avg", "exp_avg_sq", "step"))) is None]
    assert len(ours) == 3  # (the kernel stepped the first three, torch the last two)


def test_the_kernel_under_triton_s_interpreter_is_adamw():
    """The kernel's wiring on the CPU (tables, gradient column, programs, masks, grad_scale write-back), alone and
    under ``CodaAdamW``: steps through Triton's interpreter against torch's CPU fused AdamW
    (``tests/adamw_interpreter_check.py``). The two
    round differently (torch's CPU kernel lerps): per step each rounds m and v at most three times and p twice, each
    within u of the tensor's largest magnitude, and the recursions do not grow a difference (beta <= 1, the decay
    1 - lr wd < 1), so three steps stay within 3 x 6 = 18 units; a wrong table or offset moves elements by the
    update (about 1e6 units)."""
    got = run_interpreter_check("adamw_interpreter_check.py")
    assert got["steps"] == [3.0] * 4 and got["uploads"] == [3]  # (three steps; a new gradient column each)
    assert got["grad_max_diff"] == [0.0, 0.0, 0.0]  # (grads divided by the scale and written back as torch's)
    assert all(v <= 18 for v in got["units"].values()), got
    # CodaAdamW on the same kernel (the CPU let through): four steps (4 x 6 = 24 units), a state_dict round trip
    # between the third and the fourth (its kept checks redone on the new state tensors), the (13,) tensor by torch
    assert got["optimizer_units"] <= 24 and got["torch_tensor_same"], got
    assert got["optimizer_steps"] == [4.0] * 5 and got["checks_current"] and got["kernel_tensors"] == 4


def test_the_state_dict_moves_between_torch_and_coda_adamw():
    a, opt_a = _run(torch.float32, "cpu", coda=True, steps=2)
    b = _params(torch.float32, "cpu")
    opt_b = torch.optim.AdamW(b, **HYPER)
    opt_b.load_state_dict(opt_a.state_dict())
    for p, q in zip(a, b):
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in opt_a.state[p])
    coda_adamw.install(opt_b)
    assert opt_b.state_dict()["param_groups"] == opt_a.state_dict()["param_groups"]


def test_hooks_run_around_the_swapped_step():
    params = _params(torch.float32, "cpu")
    opts = OptimizersContainer([torch.nn.ParameterList(params)], torch.optim.AdamW, dict(HYPER))
    coda_adamw.install(opts)
    seen = []
    inner = opts.optimizers[0]
    inner.register_step_pre_hook(lambda *_: seen.append("pre"))
    inner.register_step_post_hook(lambda *_: seen.append("post"))
    _grads(params, 0)
    opts.step()
    assert type(inner) is coda_adamw.CodaAdamW and seen == ["pre", "post"]


def test_plan_covers_every_element_once():
    numels = [1, 4096, 4097, 8192 * 3 + 8, 8]
    blocks = kernel.plan(numels, block=4096)
    for t, n in enumerate(numels):
        mine = sorted(b for tt, b in blocks if tt == t)
        assert mine == list(range(-(-n // 4096)))


def test_tables_upload_the_gradient_column_only_when_it_moved():
    t = kernel.Tables()
    p, m, v, s = torch.zeros(16), torch.zeros(16), torch.zeros(16), torch.zeros(())
    g1, g2 = torch.zeros(16), torch.zeros(16)
    table, gtab, blocks, n = t.get([(p, g1, m, v, s)], "cpu")
    assert n == 1 and table.tolist() == [[t.data_ptr() // 16 for t in (p, m, v, s)] + [2]]
    assert gtab.tolist() == [g1.data_ptr() // 16]
    lst = next(iter(t.lists.values()))
    assert t.get([(p, g1, m, v, s)], "cpu")[0] is table and lst.uploads == 1  # (same addresses: nothing uploaded)
    again = t.get([(p, g2, m, v, s)], "cpu")  # (a new gradient: only its column)
    assert again[0] is table and again[1] is gtab and gtab.tolist() == [g2.data_ptr() // 16] and lst.uploads == 2
    assert len(t.lists) == 1


@pytest.mark.parametrize("kwargs, why", [
    ({"fused": False, "foreach": True}, "fused AdamW"),
    ({"amsgrad": True}, "amsgrad"),
    ({"lr": torch.tensor(1e-3)}, "float learning rate"),
])
def test_install_refuses_what_the_kernel_does_not_compute(kwargs, why):
    opt = torch.optim.AdamW(_params(torch.float32, "cpu"), **{**HYPER, **kwargs})
    with pytest.raises(ValueError, match=why):
        coda_adamw.install(opt)
    with pytest.raises(ValueError, match="torch.optim.AdamW"):
        coda_adamw.install(torch.optim.SGD(_params(torch.float32, "cpu"), lr=0.1))


@pytest.mark.parametrize("change, needs", [
    ({"world_size": 2}, "a single device"),
    ({"implementation": "foreach"}, 'implementation = "fused"'),
    ({"name": "Adam"}, 'name = "AdamW"'),
    ({"early_step_in_backward": True}, "early_step_in_backward = false"),
])
def test_the_config_check_names_what_is_missing(change, needs):
    optimizer_check_refuses(coda_adamw.check, "coda_adamw", change, needs)
