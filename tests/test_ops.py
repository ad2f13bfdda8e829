"""The ``torch.ops.coda`` custom ops: schemas, fakes and compile-ability, checked on CPU.

On CPU each op runs its reference implementation, so these tests prove what does not depend on the
kernels: ``torch.library.opcheck`` (schema, fake tensor shapes/dtypes/strides, autograd
registration, ``aot_dispatch``). A whole model on the custom ops under ``torch.compile(fullgraph=True)``
is in ``test_compile.py``; the same ops with the CUDA kernels are checked on the GPU in ``test_cute.py``.
"""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels import PROGRAMS
from coda_titan.kernels._common import interleave_rows
from coda_titan.model.rope import rope_freqs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

M, D, F, V, HQ, HKV, HD, SEQ = 12, 32, 24, 40, 4, 2, 8, 6


def _cases(dtype):
    g = torch.Generator().manual_seed(0)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt)

    q = (HQ + 2 * HKV) * HD
    rstd = torch.rand(M, generator=g) + 0.5
    freqs = rope_freqs(HD, 10000.0, RoPEScalingArgs())
    targets = torch.randint(0, V, (M,), generator=g)
    targets[3] = -100
    rope = (freqs, SEQ, HQ + HKV, HD)
    return {
        "rms_partial": (r(M, D), r(D), 16),
        "residual_rms": (r(M, 16), r(D, 16), r(M, D), r(D), 16),
        "rstd_finalize": (torch.rand(M, 3, generator=g), D, 1e-5),
        "norm_swiglu": (r(M, D), rstd, interleave_rows(r(F, D), r(F, D))),
        "norm_rope": (r(M, D), rstd, r(q, D), *rope),
        "lm_head_ce": (r(M, D), rstd, r(M, D), r(D), r(V, D), targets, 5, True),
        "rope_bwd": (r(M, q), r(M, q), rstd, *rope),
        "norm_residual_bwd": (r(M, q), r(q, D), r(M, D), r(D), rstd, r(M, dt=torch.float32), r(M, D)),
        "swiglu_bwd": (r(M, D), r(D, F), r(M, 2 * F), rstd),
        "wgrad": (r(M, F), r(M, D), dtype),
        "dgrad": (r(M, F), r(F, D), dtype),
    }


def test_every_program_has_an_op():
    assert all(hasattr(torch.ops.coda, name) for name in PROGRAMS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (the fp8 programs' ops are checked in tests/test_fp8.py: CPU float8 tensors lack test_schema's arithmetic)
@pytest.mark.parametrize("name", sorted(p for p in PROGRAMS if "fp8" not in p and p != "quantize_tensorwise"))
def test_opcheck(name, dtype):
    args = _cases(dtype)[name]
    opcheck(getattr(torch.ops.coda, name).default, args)


def test_opcheck_optional_residual_and_loss_only():
    args = list(_cases(torch.float32)["norm_residual_bwd"])
    args[-1] = None
    opcheck(torch.ops.coda.norm_residual_bwd.default, tuple(args))
    args = list(_cases(torch.float32)["lm_head_ce"])
    args[-1] = False
    opcheck(torch.ops.coda.lm_head_ce.default, tuple(args))
