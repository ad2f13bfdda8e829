"""Run by tests/test_adamw.py in a subprocess with TRITON_INTERPRET=1: ``kernels.adamw.adamw_step`` (its tables,
gradient column, programs and masks) on CPU tensors through Triton's interpreter, three steps (the last with a
grad_scale), then ``titan.coda_adamw.CodaAdamW`` on it for four, against torch's fused AdamW on the CPU. The two
differ in rounding only (torch's CPU kernel groups its arithmetic its own way, as a lerp), so each tensor's largest
difference is reported in units of fp32's roundoff of the tensor's largest magnitude; the test judges it. A wrong table, offset or mask moves elements by
the update itself (lr = 1e-2 against parameters of 0.05: about 1e6 units)."""

import json
import sys
from pathlib import Path

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coda_titan.kernels import adamw  # noqa: E402


class _Libdevice:
    """Triton's interpreter has no libdevice: b^t as exp2(t log2 b) in fp64 (about 1e-16 apart from pow, far
    under the check's units once rounded to fp32)."""

    @staticmethod
    def pow(base, exp):
        return tl.exp2(tl.log2(base) * exp)


adamw.libdevice = _Libdevice

torch.manual_seed(0)
shapes = [(3000,), (64, 40), (8,), (2056,)]  # (counts across one and several programs, a ragged last program)
hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
ref = [torch.nn.Parameter(torch.randn(s) * 0.05) for s in shapes]
ours = [p.detach().clone() for p in ref]
state = [(torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())) for p in ours]
opt = torch.optim.AdamW(ref, fused=True, **hyper)
tables = adamw.Tables()
grads_seen = []
for step in range(3):
    scale = torch.tensor(1.25) if step == 2 else None
    gs = [torch.randn(s) * 1e-2 for s in shapes]
    for p, g in zip(ref, gs):
        p.grad = g.clone()
    opt.grad_scale = scale
    opt.step()
    mine = [g.clone() for g in gs]
    adamw.adamw_step(ours, mine, [s[0] for s in state], [s[1] for s in state], [s[2] for s in state],
                     lr=hyper["lr"], beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, grad_scale=scale,
                     tables=tables, block=1024, warps=4)
    grads_seen.append(max(float((a - b.grad).abs().max()) for a, b in zip(mine, ref)))
u = 2.0**-24
worst = {}
picks = {"p": lambda i: (ours[i], ref[i].detach()),
         "exp_avg": lambda i: (state[i][0], opt.state[ref[i]]["exp_avg"]),
         "exp_avg_sq": lambda i: (state[i][1], opt.state[ref[i]]["exp_avg_sq"])}
for name, pick in picks.items():
    worst[name] = max(float((a - b).abs().max() / (u * b.abs().max())) for a, b in map(pick, range(len(shapes))))

# The optimizer around it (titan/coda_adamw.py), the CPU let through to the kernel: three steps, a state_dict round
# trip (new state tensors: the kept checks must be redone), a fourth step; the (13,) tensor steps through torch.
from coda_titan.titan import coda_adamw  # noqa: E402

adamw._DEVICES = ("cuda", "cpu")
shapes2 = shapes + [(13,)]
ref2 = [torch.nn.Parameter(torch.randn(s) * 0.05) for s in shapes2]
ours2 = [torch.nn.Parameter(p.detach().clone()) for p in ref2]
o_ref, o_ours = torch.optim.AdamW(ref2, fused=True, **hyper), torch.optim.AdamW(ours2, fused=True, **hyper)
coda_adamw.install(o_ours)
for step in range(4):
    if step == 3:
        o_ours.load_state_dict(o_ours.state_dict())
    for a, b in zip(ref2, ours2):
        a.grad = torch.randn(a.shape) * 1e-2
        b.grad = a.grad.clone()
    for o in (o_ref, o_ours):
        o.grad_scale = torch.tensor(1.25) if step == 2 else None
        o.step()
checks = o_ours.__dict__["_coda_state_checks"]
units2 = max(float((a - b).abs().max() / (u * b.abs().max())) for a, b in zip(ours2[:-1], ref2))
print(json.dumps({"units": worst, "steps": [float(s[2]) for s in state], "grad_max_diff": grads_seen,
                  "uploads": [lst.uploads for lst in tables.lists.values()],
                  "optimizer_units": units2, "torch_tensor_same": bool(torch.equal(ours2[-1], ref2[-1])),
                  "optimizer_steps": [float(o_ours.state[p]["step"]) for p in ours2],
                  "checks_current": all(checks[id(p)][1] is o_ours.state[p]["exp_avg"] for p in ours2),
                  "kernel_tensors": sum(checks[id(p)][4] is None for p in ours2)}))
