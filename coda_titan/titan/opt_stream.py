"""``[coda] optimizer_stream``: TorchTitan's optimizer step on a CUDA stream of its own.

Why: TorchTitan's train step copies the batch to the GPU with a synchronizing ``.to(device)``, so every
forward starts with an empty GPU queue, and wherever the host enqueues the forward slower than the GPU
runs it, the GPU waits. The compiled CODA fp8 forward is such a case: on an H100 its host time and the
GPU span of the same forward agreed within 0.1 ms on almost every step, and the step time followed the
host's forward time (``scripts/probes/host_slack.py``, docs/fp8.md). With the step on a side stream,
that copy waits only for the backward (the main stream's last work): the host enqueues the next
forward while the GPU still runs the optimizer step, and the forward's first GPU work waits for the
step on the GPU (``wait``), not on the host.

What keeps it correct, on one GPU (``check``):

* the side stream waits for the main stream before the step (the backward and the gradient clipping
  are in), and the hooks keep a reference to each gradient the step reads until the next ``wait``:
  TorchTitan's ``zero_grad`` drops its own, and the memory goes back to the main stream's pool only
  once the main stream is ordered after the step. (The first version marked each gradient used on
  the side stream, ``record_stream``: the allocator then holds the memory back until it sees, by
  polling an event at the host's allocations, that the step is done, and the host runs ahead of the
  step. With it the compiled bf16 config held 1 GiB more reserved than without the knob; that this
  was the cause, and that this version removes it, is not measured yet: docs/history.md);
* the first step stays on the main stream: it allocates the optimizer state, which then comes from
  the main stream's pool, as without the knob (on the 1B fp8 config the reserved memory after the
  first steps is the same either way: 27.10 GiB with the whole step on the side stream, 27.29 with
  the first on the main stream and 27.29 without the knob, docs/history.md). Later steps allocate next
  to nothing, and the parameters and the optimizer state are never freed;
* everything that reads the parameters or the optimizer state after a step waits for it first: the
  model's forward (``CodaTransformer.forward``), its ``state_dict`` and each optimizer's (checkpoints),
  and the fp8 weight pass the step's post-hook issues (``prefetch_fp8_weights``), which runs while the
  side stream is still the current one, so its own stream is ordered after the step;
* with ``step_chunk_layers`` (``chunked_step``) the same per chunk: each chunk's weight pass is issued
  after its update, each block of the forward waits for its own chunk (``wait_for``), the LM head for
  the whole step, and a chunk's gradients go once the main stream has waited for it.
"""

from __future__ import annotations

import types

import torch


class OptimizerStream:
    """The hooks around one ``OptimizersContainer.step`` (``install``)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.stream: torch.cuda.Stream | None = None
        self.main: torch.cuda.Stream | None = None
        self.pending: list = []  # (the first layer that needs it, event) in step order: what the forward still waits for
        self.first = True
        self.held: list = []  # (the first block that needs its chunk, gradient) of the last step, until its wait
        self.first_of: dict[int, int] = {}  # parameter id -> the first block that needs its chunk (empty: unchunked)

    def _device(self):
        for p in self.params:
            if p.is_cuda:
                return p.device
        return None

    def before_step(self, *_) -> None:
        """Make the side stream current, ordered after the main stream's work."""
        device = self._device()
        if device is None:
            return  # (CPU: nothing to overlap)
        if self.first:  # (the optimizer state is allocated on the main stream)
            self.first = False
            return
        main = torch.cuda.current_stream(device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(main)
        self.held = [(self.first_of.get(id(p), -1), p.grad) for p in self.params if p.grad is not None]
        self.pending = []  # (a step no forward waited for: this one's events follow its own on the stream)
        self.main = main
        torch.cuda.set_stream(self.stream)

    def chunk_done(self, layer: int) -> None:
        """A chunk of the step is enqueued; the forward's block ``layer`` (-1: its start) is the first to need it."""
        if self.main is not None:
            self.pending.append((layer, self.stream.record_event()))

    def after_step(self, *_) -> None:
        """Record the step's end and make the main stream current again (the last post-hook)."""
        if self.main is None:
            return
        self.chunk_done(float("inf") if self.first_of else -1)  # (unchunked: the forward's start waits for it all)
        torch.cuda.set_stream(self.main)
        self.main = None

    def wait_for(self, layer: int | None) -> None:
        """The current stream waits (on the GPU) for the step's chunks that block ``layer`` needs (None: the
        whole step), each once, and lets the gradients those chunks read go (freed now, their blocks are
        reused only by work ordered after their chunk)."""
        ready = [event for first, event in self.pending if layer is None or first <= layer]
        if ready:  # (events of one stream, in order: the last one implies the others)
            torch.cuda.current_stream(ready[-1].device).wait_event(ready[-1])
            self.pending = self.pending[len(ready):]
        if not self.pending:
            self.held = []
        elif ready:
            self.held = [(first, g) for first, g in self.held if first > layer]

    def wait(self, *_) -> None:
        """``wait_for(None)``, as a ``state_dict`` pre-hook."""
        self.wait_for(None)


def chunk_plan(model, per_chunk: int) -> list[tuple[frozenset, int, tuple[int, int] | None]]:
    """``[coda] step_chunk_layers``: the step's parameters in the order the forward reads them, as
    (parameter ids, the first block that needs them (-1: the forward's start), its layer span or None):
    the embedding and every norm; then the layers, ``per_chunk`` at a time; then the LM head."""
    n = len(model.layers)
    keys: dict[int, list] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers" and p.dim() >= 2:
            key = int(parts[1]) // per_chunk * per_chunk
        else:
            key = n if parts[0] == "output" else -1
        keys.setdefault(key, []).append(id(p))
    return [(frozenset(ids), key, (key, min(key + per_chunk, n)) if 0 <= key < n else None)
            for key, ids in sorted(keys.items())]


def chunked_step(opt, hooks: OptimizerStream, plan, on_layers) -> None:
    """Make ``opt.step()`` step ``plan``'s chunks one after another (the same per-parameter update: each
    chunk is the same groups restricted to its parameters), after ``on_layers()`` (the fp8 scales the
    forward's start reads), each followed by ``on_layers(start, stop)`` for a layer chunk (its fp8 weight
    pass) and a stream event the forward's blocks wait for."""
    cls = type(opt)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("[coda] step_chunk_layers: an optimizer step with a closure is not supported")
        groups = self.param_groups
        on_layers()
        try:
            for ids, first, span in plan:
                self.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in groups]
                cls.step(self)
                if span is not None:
                    on_layers(*span)
                hooks.chunk_done(first)
        finally:
            self.param_groups = groups

    opt.step = types.MethodType(step, opt)  # (bound: an LR scheduler wraps it as it wraps the class's)


def install(optimizers, model_parts: list[torch.nn.Module], per_chunk: int = 0) -> OptimizerStream:
    """Put ``optimizers``' steps on a side stream; call after every other post-hook is registered (the
    fp8 weight pass must run on the step's stream). Each model part waits for the step at its forward
    (``optimizer_stream`` attribute) and at its ``state_dict``, each optimizer at its ``state_dict``.
    With ``per_chunk`` layers a chunk (one model part, one optimizer) the step runs in chunks
    (``chunked_step``) and each of the forward's blocks waits only for its own."""
    hooks = OptimizerStream([p for m in model_parts for p in m.parameters()])
    if per_chunk:
        opts = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(model_parts) != 1 or len(opts) != 1:
            raise ValueError(f"[coda] step_chunk_layers needs one model part and one optimizer, got "
                             f"{len(model_parts)} and {len(opts)}")
        part = model_parts[0]
        plan = chunk_plan(part, per_chunk)
        chunked_step(opts[0], hooks, plan, part.prefetch_fp8_chunk)
        hooks.first_of = {i: first for ids, first, _ in plan for i in ids}
    optimizers.register_step_pre_hook(hooks.before_step)
    optimizers.register_step_post_hook(hooks.after_step)
    for m in model_parts:
        m.optimizer_stream = hooks
        m.register_state_dict_pre_hook(hooks.wait)
    for opt in getattr(optimizers, "optimizers", [optimizers]):
        opt.register_state_dict_pre_hook(hooks.wait)
    return hooks


def check(job_config, parallel_dims, model=None) -> None:
    """``[coda] optimizer_stream`` (with ``step_chunk_layers``) is a one-GPU knob: under FSDP2 or DDP, whose
    own streams would read the parameters before the forward's wait, it is turned off with one log line
    (so that a config tuned on one GPU runs sharded as it is); with ``cuda_graphs``, and
    ``step_chunk_layers`` without it, are refused with one line."""
    from .job_config import ConfigError

    coda = getattr(job_config, "coda", None)
    if getattr(coda, "step_chunk_layers", 0) and not getattr(coda, "optimizer_stream", False):
        raise ConfigError("[coda] step_chunk_layers > 0 needs [coda] optimizer_stream = true"
                          " (or leave it at 0: --coda.step_chunk_layers 0)")
    if not getattr(coda, "optimizer_stream", False):
        return
    if getattr(coda, "cuda_graphs", False):
        raise ConfigError("[coda] optimizer_stream = true needs [coda] cuda_graphs = false"
                          " (or turn it off: --coda.no_optimizer_stream)")
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        from torchtitan.tools.logging import logger

        logger.info("coda_titan: [coda] optimizer_stream runs on one GPU only: off under FSDP2 / DDP")
        for c in (coda, getattr(getattr(model, "model_args", None), "coda", None)):
            if c is not None:
                c.optimizer_stream, c.step_chunk_layers = False, 0
