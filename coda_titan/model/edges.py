"""The autograd edges the CODA Functions share: gradients returned by input name, and the amax tokens.

An amax token is a side channel between two Functions through an ordinary autograd edge (so it works compiled,
as ``fp8_scaling.GradAmaxSink`` does): the Function whose backward casts its output's gradient dX to e5m2 at
its current amax returns a token as its last output; the Function that consumes that output takes the token as
an input and, since it makes dX (its B2), returns amax |dX| as the token's gradient. The cast then needs no
amax pass of its own (the fp8 B2 reduces the amax in its epilogue).
"""

from __future__ import annotations

import torch

from ..kernels.scaling import amax_abs


def amax_token(like: torch.Tensor) -> torch.Tensor:
    """A Function's amax token output (its value is never read)."""
    return torch.empty((), device=like.device, dtype=torch.float32)


def amax_grad(dx: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """The gradient a producer returns for an amax token: its B2's amax |dX|, else (a bf16 B2) dX's own."""
    return (amax_abs(dx) if amax is None else amax).float().reshape(())


def needs(ctx, inputs: tuple[str, ...], name: str) -> bool:
    """Whether the forward input ``name`` (of ``inputs``, in order) was given and wants a gradient (an
    ``apply`` may stop before its trailing optional inputs)."""
    i = inputs.index(name)
    return i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]


def grads(inputs: tuple[str, ...], **given) -> tuple:
    """The backward's return: the gradient named for each forward input, None for the others."""
    unknown = set(given) - set(inputs)
    assert not unknown, f"gradients for inputs that do not exist: {unknown}"
    return tuple(given.get(name) for name in inputs)
