"""``[coda] input_stream`` (``coda_titan.titan.input_stream``): the batch's copies on a CUDA stream of their
own. CPU: the stream protocol against a recording fake of ``torch.cuda``, through a stand-in Trainer whose
``train_step`` calls the wrapped methods in the order TorchTitan 0.2.2's does (which stream each of its
steps runs on, what the compute stream waits for, which tensors are marked as used on it), the knob's
refusal to act off the GPU and with it off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coda_titan.titan import input_stream
from coda_titan.titan.job_config import Coda

from .helpers import FakeCuda


def _cuda():
    """A fake ``torch.cuda``; its log also holds the calls of the stand-in Trainer below, with the stream
    current at each."""
    return FakeCuda("compute", "input")


class _Copy:
    """A tensor the batch's ``.to(device)`` made: on "cuda", it logs ``record_stream``."""

    device = torch.device("cuda")

    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def record_stream(self, stream):
        self.cuda.log.append(("record_stream", self.name, stream.name))


class _Trainer:
    """The part of TorchTitan's Trainer the knob wraps: ``batch_generator`` and ``forward_backward_step``,
    called in ``train_step``'s order (fetch every microbatch, copy, then one forward-backward each)."""

    def __init__(self, cuda, coda, device="cuda:0", microbatches=1):
        self.cuda, self.device, self.microbatches = cuda, torch.device(device), microbatches
        self.job_config = SimpleNamespace(coda=coda)

    def batch_generator(self, data):
        for batch in data:
            self.cuda.log.append(("fetch", batch, self.cuda.current))
            yield batch

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        self.cuda.log.append(("forward_backward", self.cuda.current))
        return "loss"

    def train_step(self, it):
        batches = [next(it) for _ in range(self.microbatches)]
        self.cuda.log.append(("copy tokens", self.cuda.current))
        tokens = _Copy(self.cuda, "tokens")
        for b in batches:
            self.cuda.log.append(("copy batch", b, self.cuda.current))
            self.forward_backward_step(input_dict={"input": _Copy(self.cuda, f"input{b}")},
                                       labels=_Copy(self.cuda, f"labels{b}"), global_valid_tokens=tokens)
        self.cuda.log.append(("optimizer", self.cuda.current))


def _run(microbatches=1, steps=2, **coda):
    cuda = _cuda()
    trainer = _Trainer(cuda, Coda(**coda), microbatches=microbatches)
    attached = input_stream.attach(trainer, cuda)
    it = trainer.batch_generator(range(steps * microbatches))
    for _ in range(steps):
        trainer.train_step(it)
    return attached, cuda.log


def _one_step(b):
    """What one step with batch ``b`` logs with the knob on."""
    return [
        ("fetch", b, "compute"), ("set_stream", "input"), ("copy tokens", "input"), ("copy batch", b, "input"),
        ("set_stream", "compute"), ("wait_stream", "compute", "input"),
        ("record_stream", f"input{b}", "compute"), ("record_stream", f"labels{b}", "compute"),
        ("record_stream", "tokens", "compute"),
        ("forward_backward", "compute"), ("optimizer", "compute"),
    ]


def test_copies_run_on_the_input_stream_and_the_forward_on_the_compute_stream():
    attached, log = _run(input_stream=True)
    assert attached
    assert log == _one_step(0) + _one_step(1)


def test_later_microbatches_are_copied_on_the_compute_stream():
    _, log = _run(microbatches=2, steps=1, input_stream=True)
    assert ("copy batch", 0, "input") in log and ("copy batch", 1, "compute") in log
    assert log.count(("set_stream", "input")) == 1 and log.count(("wait_stream", "compute", "input")) == 1
    assert [e for e in log if e[0] == "forward_backward"] == [("forward_backward", "compute")] * 2
    assert log[-1] == ("optimizer", "compute")


@pytest.mark.parametrize("coda, device", [({"input_stream": False}, "cuda:0"), ({"input_stream": True}, "cpu")])
def test_nothing_changes_with_the_knob_off_or_off_the_gpu(coda, device):
    cuda = _cuda()
    trainer = _Trainer(cuda, Coda(**coda), device=device)
    before = (trainer.batch_generator, trainer.forward_backward_step)
    assert not input_stream.attach(trainer, cuda)
    assert (trainer.batch_generator, trainer.forward_backward_step) == before


def test_the_cli_attaches_it_after_the_trainer_is_built():
    import inspect

    from coda_titan import cli

    src = inspect.getsource(cli.train)
    assert src.index("Trainer(config)") < src.index("input_stream.attach(trainer)") < src.index("trainer.train()")
