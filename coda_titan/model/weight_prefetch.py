"""The fp8 weight pass issued ahead of the forward that reads it (``[coda] prefetch_weights``), whole or in
layer chunks (``[coda] step_chunk_layers``), and its hand-over to that forward.

At a step's end the host is ahead of the GPU; at the next one's start it has just waited for it
(TorchTitan's batch copy synchronizes), so the optimizer step issues the next forward's e4m3 weights
and delayed scales. On CUDA each pass runs on a side stream ordered after the optimizer's work on the
weights it reads; the forward waits for a chunk's pass at its first layer, and uses the passes only if
every layer parameter is the same tensor at the same version and the same weights are needed (else
it computes its own, after the whole step). Memory: a side stream's next pass waits for the next
optimizer step, which follows every use of these tensors on the main stream, so the allocator may
hand their blocks back to it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch


class Prefetched(NamedTuple):
    """One issued pass: the weights of ``layers[start:stop]`` for ``flags``."""

    flags: tuple
    start: int
    stop: int
    versions: tuple
    done: tuple | None  # (device, the side stream's event after the pass), CUDA only
    ws: tuple


def param_versions(layers) -> tuple:
    """Each layer parameter's identity and in-place version: what a prefetched weight pass read."""
    return tuple((id(p), p._version) for layer in layers for p in layer.parameters())


def is_sharded(block: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(block, FSDPModule)


def _side_stream(model, device: torch.device) -> torch.cuda.Stream:
    if getattr(model, "_side_stream", None) is None or model._side_stream.device != device:
        model._side_stream = torch.cuda.Stream(device)
    return model._side_stream


def _on(model, layers) -> bool:
    coda = model.model_args.coda
    return coda.precision == "fp8" and coda.prefetch_weights and bool(layers) and model.training and not is_sharded(layers[0])


def begin(model) -> bool:
    """Begin a step's set: take the delayed scales the next forward reads (on the current stream, before any
    chunk of the step is marked done: the forward's prologue reads them). Returns whether passes will be issued."""
    model._prefetched = []
    layers = list(model.layers.values())
    if not _on(model, layers):
        return False
    with torch.no_grad():  # the scales: pure functions of the histories until the next forward records
        model.fp8_scaling.prepare(list(model._scale_sites(model._weight_pass_flags(True))))
    return True


def issue(model, start: int = 0, stop: int | None = None) -> bool:
    """Issue the next training forward's pass over ``layers[start:stop]`` (all by default), after ``begin``.
    Returns whether a pass was issued."""
    layers = list(model.layers.values())
    stop = len(layers) if stop is None else stop
    if not _on(model, layers):
        return False
    cfg, flags = model.program_config(), model._weight_pass_flags(True)
    device = layers[0].attention.wq.weight.device
    side = None
    if device.type == "cuda":
        side = _side_stream(model, device)
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        ws = model._weight_pass(layers[start:stop], cfg, flags)
        done = (device, side.record_event()) if side is not None else None
    model._prefetched.append(Prefetched(flags, start, stop, param_versions(layers[start:stop]), done, ws))
    return True


def take(model, layers, flags: tuple) -> Callable[[int], tuple] | None:
    """``layer -> (weight-pass tuple, index in it)`` over the prefetched passes if together they hold for
    this forward (else None), once; each chunk's side stream is waited for at its first layer's lookup."""
    pre, model._prefetched = getattr(model, "_prefetched", None) or [], []
    starts = [0] + [p.stop for p in pre[:-1]]  # (the chunks must tile the layers in order)
    if not pre or pre[-1].stop != len(layers) or any(p.start != s for p, s in zip(pre, starts)):
        return None
    if any(p.flags != flags or p.versions != param_versions(layers[p.start:p.stop]) for p in pre):
        return None
    waited: set[int] = set()

    def lookup(i: int) -> tuple:
        k = next(k for k, p in enumerate(pre) if p.start <= i < p.stop)
        if k not in waited and pre[k].done is not None:  # (the side stream's pass, before this stream's first use)
            torch.cuda.current_stream(pre[k].done[0]).wait_event(pre[k].done[1])
        waited.add(k)
        return pre[k].ws, i - pre[k].start

    return lookup
