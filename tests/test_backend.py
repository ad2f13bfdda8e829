"""Backend selection: ``auto`` / ``torch`` / ``cute`` and the one-interface contract."""

import inspect

import pytest
import torch

from coda_titan import kernels
from coda_titan.kernels import BackendUnavailable, get_backend, resolve_backend


def test_torch_backend_has_every_program():
    be = get_backend("torch")
    for name in kernels.PROGRAMS:
        fn = getattr(be, name)
        params = inspect.signature(fn).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in params), f"{name} must take keyword-only arguments"


def test_resolve():
    assert resolve_backend("torch") == "torch"
    expected = "torch" if kernels.cute_unavailable_reason() else "cute"
    assert resolve_backend("auto") == expected
    with pytest.raises(BackendUnavailable, match="one of"):
        resolve_backend("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cute_refused_without_gpu():
    with pytest.raises(BackendUnavailable, match="no CUDA GPU"):
        resolve_backend("cute")
    with pytest.raises(BackendUnavailable):
        get_backend("cute")
