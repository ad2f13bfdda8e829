"""``[coda] input_stream``: the batch's copies to the GPU on a CUDA stream of their own.

Why: TorchTitan 0.2.2's ``train_step`` moves the token count, the inputs and the labels to the GPU with
``.to(device)``, which waits for everything queued on the current stream (``cudaStreamSynchronize``).
So each step's host work starts only once the GPU has run the previous step's backward, and wherever the
host enqueues the next forward slower than the GPU runs it, the GPU waits. The compiled CODA fp8 step
is such a case (``compare_pin_memory_fp8_…json``, host medians a step: forward 75.3 ms, backward 90.0,
optimizer 25.4, against a 226.5 ms step; float8's host waits 96.9 ms a step; ``probe_host_slack_…json``: its
forward's GPU span falls from 58 to 46 ms once the host is ahead). ``optimizer_stream`` only takes the
optimizer step out of that wait.

With this knob the copies run on a stream with nothing else on it, so they return at once, and the
host enqueues step N + 1 while the GPU still runs step N. Nothing else in TorchTitan's step changes:
``attach`` wraps two of the Trainer's own methods on the instance (its loop stays TorchTitan's):

* ``batch_generator``: after each batch is fetched, the input stream becomes the current stream, so
  TorchTitan's ``.to(device)`` calls (and the token count's ``.float()``) are queued there;
* ``forward_backward_step``: the previous current stream (the compute stream) becomes current again
  before the forward, waits on the GPU for the copies (``wait_stream``), and every tensor the copies
  made is marked as used on it (``record_stream``), so the allocator reuses their blocks only after
  the compute stream is past their last use (the labels and the token count are read in the backward).

The metrics' ``.item()`` calls at each log step (``metrics.log_freq``) still synchronize: a config
that logs every step keeps a synchronization per step. With several microbatches (gradient
accumulation) only the first one's copies leave the wait; the later ones are queued on the compute
stream as without the knob. Off the GPU the knob does nothing.
"""

from __future__ import annotations

import functools

import torch


def _tensors(obj):
    """The tensors in a call's arguments (anything with ``record_stream``), through dicts, lists and tuples."""
    if hasattr(obj, "record_stream"):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class InputStream:
    """The two wrappers (``attach``); ``cuda`` is the ``torch.cuda`` namespace (a stand-in in CPU tests)."""

    def __init__(self, device, cuda=torch.cuda):
        self.device, self.cuda = device, cuda
        self.stream = None
        self.compute = None  # (the stream the input stream replaced as current; None: not switched)

    def after_fetch(self) -> None:
        """Make the input stream current (the batch's copies follow); remember the stream it replaces."""
        if self.compute is not None:  # (a second microbatch fetched before a forward: stays switched)
            return
        if self.stream is None:
            self.stream = self.cuda.Stream(self.device)
        self.compute = self.cuda.current_stream(self.device)
        self.cuda.set_stream(self.stream)

    def before_forward(self, *args, **kwargs) -> None:
        """The compute stream current again, ordered after the copies, each copy marked as used on it."""
        if self.compute is None:
            return
        compute, self.compute = self.compute, None
        self.cuda.set_stream(compute)
        compute.wait_stream(self.stream)
        for t in _tensors((args, kwargs)):
            if t.device.type == "cuda":
                t.record_stream(compute)

    def wrap(self, trainer) -> None:
        batches, fwd_bwd = trainer.batch_generator, trainer.forward_backward_step

        @functools.wraps(batches)
        def batch_generator(*a, **k):
            for batch in batches(*a, **k):
                self.after_fetch()
                yield batch

        @functools.wraps(fwd_bwd)
        def forward_backward_step(*a, **k):
            self.before_forward(*a, **k)
            return fwd_bwd(*a, **k)

        trainer.batch_generator, trainer.forward_backward_step = batch_generator, forward_backward_step
        trainer._coda_input_stream = self


def attach(trainer, cuda=torch.cuda) -> bool:
    """With ``[coda] input_stream`` on a CUDA device: wrap ``trainer``'s batch fetch and forward-backward
    (above); False (nothing changed) otherwise."""
    coda = getattr(trainer.job_config, "coda", None)
    device = getattr(trainer, "device", None)
    if not getattr(coda, "input_stream", False) or device is None or torch.device(device).type != "cuda":
        return False
    InputStream(torch.device(device), cuda).wrap(trainer)
    return True
