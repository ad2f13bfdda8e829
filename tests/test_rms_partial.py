"""rms_partial (prologue) and rstd_finalize: the op schemas; the fp8 prologue is checked with F1 in
test_residual_rms.py, the finalize kernel on the GPU."""

import pytest
import torch
from torch.library import opcheck


from .helpers import DIMS, check_cute_matches_reference, op_cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['rms_partial', 'rstd_finalize'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['rstd_finalize'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)
