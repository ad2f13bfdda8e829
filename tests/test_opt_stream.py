"""``[coda] optimizer_stream`` (``coda_titan.titan.opt_stream``): the optimizer step on a CUDA stream of
its own. CPU: the stream protocol against a recording fake of ``torch.cuda`` (what waits for what, in
which order, and that nothing waits twice), the hook order ``build_coda_optimizers`` installs, the
refusals, and a CPU step that is unchanged. GPU: a short training run with it equals one without, bit
for bit."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from coda_titan.model.args import coda_llama3_args
from coda_titan.model.model import CodaTransformer
from coda_titan.titan import opt_stream
from coda_titan.titan.job_config import Coda

from .helpers import FakeCuda, FakeStream


class _Stream(FakeStream):
    """A ``FakeStream`` with the events ``opt_stream`` records and waits for."""

    def record_event(self):
        self.rec.log.append(("record_event", self.name))
        return SimpleNamespace(device="cuda:0", name=f"{self.name}_done")

    def wait_event(self, event):
        self.rec.log.append(("wait_event", self.name, event.name, len(self.rec.hooks.held)))


class _Recorder(FakeCuda):
    """A fake ``torch.cuda`` for ``opt_stream``: streams and events that log what they are asked."""

    stream_class = _Stream

    def __init__(self):
        super().__init__("main", "side")


class _Grad:
    def __init__(self, rec, i):
        self.rec, self.i = rec, i

    def record_stream(self, stream):  # (the allocator would learn of the step's end only by polling)
        self.rec.log.append(("record_stream", self.i, stream.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(opt_stream.torch, "cuda", rec)
    return rec


def test_the_step_runs_on_the_side_stream_after_the_main_streams_work_and_the_forward_waits_for_it_once(fake_cuda):
    rec = fake_cuda
    params = [SimpleNamespace(is_cuda=True, device="cuda:0", grad=_Grad(rec, i)) for i in range(2)]
    params.append(SimpleNamespace(is_cuda=True, device="cuda:0", grad=None))  # (a frozen or unused parameter)
    hooks = rec.hooks = opt_stream.OptimizerStream(params)
    hooks.before_step()  # the first step allocates the optimizer state: it stays on the main stream
    hooks.after_step()
    hooks.wait()
    assert rec.log == [] and rec.current == "main" and hooks.held == []
    hooks.before_step()
    assert rec.log == [("wait_stream", "side", "main"), ("set_stream", "side")]
    assert rec.current == "side"  # (what the step and the post-hooks before after_step enqueue goes there)
    assert [g for _, g in hooks.held] == [params[0].grad, params[1].grad]  # the step's gradients, kept past zero_grad
    rec.log.clear()
    hooks.after_step()
    assert rec.log == [("record_event", "side"), ("set_stream", "main")] and rec.current == "main"
    for p in params:
        p.grad = None  # (TorchTitan's zero_grad: the hooks' references keep the memory)
    assert len(hooks.held) == 2
    rec.log.clear()
    hooks.wait()
    hooks.wait()  # (once per step: the main stream is ordered after the step from then on)
    # the main stream waits for the step while the gradients are still held, and lets them go after
    assert rec.log == [("wait_event", "main", "side_done", 2)] and hooks.held == []


def test_a_chunked_step_is_waited_for_per_block_and_each_chunks_gradients_go_at_its_wait(fake_cuda):
    """``[coda] step_chunk_layers``: each chunk's event is waited for by the first block that needs it
    (the forward's start for the embedding and norms), once; a block whose chunk is in waits for nothing;
    the LM head (``None``) waits for the rest; each chunk's gradients go once its event is waited for."""
    rec = fake_cuda
    params = [SimpleNamespace(is_cuda=True, device="cuda:0", grad=_Grad(rec, i)) for i in range(4)]
    hooks = rec.hooks = opt_stream.OptimizerStream(params)
    hooks.first = False
    hooks.first_of = {id(p): first for p, first in zip(params, (-1, 0, 2, 4))}  # (a gradient per chunk)
    hooks.before_step()
    for first in (-1, 0, 2, 4):  # (the embedding and norms, layers 0-1, layers 2-3, the LM head)
        hooks.chunk_done(first)
    hooks.after_step()
    assert [e for e in rec.log if e[0] == "record_event"] == [("record_event", "side")] * 5
    rec.log.clear()
    for layer, kept in ((-1, 3), (0, 2), (1, 2), (2, 1), (3, 1)):
        hooks.wait_for(layer)  # (each chunk's gradient goes once the main stream waited for that chunk)
        assert [g for _, g in hooks.held] == [p.grad for p in params[4 - kept:]], layer
    assert [e[0] for e in rec.log] == ["wait_event"] * 3  # (-1, 0 and 2: layers 1 and 3 are in)
    hooks.wait_for(None)
    assert [e[0] for e in rec.log] == ["wait_event"] * 4 and hooks.held == [] and hooks.pending == []
    hooks.wait_for(None)
    assert len(rec.log) == 4


def test_the_chunk_plan_covers_every_parameter_once_in_the_order_the_forward_reads_them():
    model = _tiny(Coda(optimizer_stream=True, step_chunk_layers=1))
    plan = opt_stream.chunk_plan(model, 1)
    ids = [i for chunk, _, _ in plan for i in chunk]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert [(first, span) for _, first, span in plan] == [(-1, None), (0, (0, 1)), (1, (1, 2)), (2, None)]
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in plan[0][0]} == {"tok_embeddings.weight", "norm.weight", "layers.0.attention_norm.weight",
                                               "layers.0.ffn_norm.weight", "layers.1.attention_norm.weight",
                                               "layers.1.ffn_norm.weight"}
    assert {names[i] for i in plan[-1][0]} == {"output.weight"}
    assert all(names[i].startswith("layers.1.") for i in plan[2][0])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_cpu_training_run_with_the_step_in_chunks_is_the_run_without(precision):
    """The chunked step is the same per-parameter update (bit for bit, three steps); every chunk steps
    its own parameters once; with fp8 each layer chunk's weight pass is issued after its update and every
    forward after the first takes the chunks' passes."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    tokens = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(1))
    runs = {}
    for per_chunk in (0, 1):
        model = _tiny(Coda(precision=precision, optimizer_stream=True, step_chunk_layers=per_chunk))
        opt = build_coda_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
        inner, stepped = opt.optimizers[0], []
        real = type(inner).step
        type(inner).step = lambda self, *a, **k: stepped.append(len(self.param_groups[0]["params"])) or real(self, *a, **k)
        taken, take = [], model._take_prefetched
        model._take_prefetched = lambda *a: taken.append(take(*a)) or taken[-1]
        try:
            losses = []
            for _ in range(3):
                loss = model(tokens, labels=tokens)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            type(inner).step = real
        spans = [(p.start, p.stop) for p in model._prefetched or []]
        runs[per_chunk] = (losses, [p.detach().clone() for p in model.parameters()], stepped, spans, taken)
    (l0, p0, s0, _, _), (l1, p1, s1, spans, taken) = runs[0], runs[1]
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))
    n = len(list(_tiny(Coda()).parameters()))
    assert s0 == [n] * 3 and len(s1) == 12 and sum(s1[:4]) == n and s1[:4] == s1[4:8]
    if precision == "fp8":
        assert spans == [(0, 1), (1, 2)] and [t is not None for t in taken] == [False, True, True]


def test_the_chunked_step_takes_the_fp8_scales_before_it_marks_any_chunk_done():
    """The forward's prologue reads the delayed scales after waiting only for the first chunk (the
    embedding and norms): the step must take them before that chunk's event, and issue each layer chunk's
    weight pass after its update and before its event."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    model = _tiny(Coda(precision="fp8", optimizer_stream=True, step_chunk_layers=1))
    opt = build_coda_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
    order, hooks = [], model.optimizer_stream
    prepare, issue, done = model.fp8_scaling.prepare, model._weight_pass, hooks.chunk_done
    model.fp8_scaling.prepare = lambda *a: order.append("scales") or prepare(*a)
    model._weight_pass = lambda blocks, *a: order.append(("pass", len(blocks))) or issue(blocks, *a)
    hooks.chunk_done = lambda first: order.append(("done", first)) or done(first)
    tokens = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).backward()
    order.clear()
    opt.step()
    assert order == ["scales", ("done", -1), ("pass", 1), ("done", 0), ("pass", 1), ("done", 1), ("done", 2)], order


def test_without_a_cuda_parameter_the_hooks_do_nothing(fake_cuda):
    hooks = opt_stream.OptimizerStream([SimpleNamespace(is_cuda=False, device="cpu", grad=None)])
    hooks.before_step()
    hooks.after_step()
    hooks.wait()
    assert fake_cuda.log == [] and fake_cuda.current == "main"


def _tiny(coda: Coda) -> CodaTransformer:
    args = dataclasses.replace(coda_llama3_args["debugmodel"], n_layers=2, coda=coda)
    torch.manual_seed(0)
    model = CodaTransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def test_build_coda_optimizers_installs_the_stream_hooks_last_and_only_when_asked():
    """The step's stream must still be current when the fp8 weight pass is issued (its side stream then
    waits for the step): ``after_step`` is the last post-hook, ``before_step`` a pre-hook; the model and
    each optimizer wait at ``state_dict`` (checkpoints)."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    for on in (False, True):
        model = _tiny(Coda(optimizer_stream=on))
        opt = build_coda_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
        post = list(opt._optimizer_step_post_hooks.values())
        pre = list(opt._optimizer_step_pre_hooks.values())
        hooks = getattr(model, "optimizer_stream", None)
        if not on:
            assert hooks is None and len(post) == 1 and not pre
            continue
        assert isinstance(hooks, opt_stream.OptimizerStream)
        assert len(post) == 2 and post[-1] == hooks.after_step and pre == [hooks.before_step]
        assert hooks.wait in model._state_dict_pre_hooks.values()
        assert all(hooks.wait in o._optimizer_state_dict_pre_hooks.values() for o in opt.optimizers)


def test_a_cpu_training_step_with_the_knob_is_the_step_without_it():
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    tokens = torch.randint(0, 2000, (2, 64), generator=torch.Generator().manual_seed(1))
    params = {}
    for on in (False, True):
        model = _tiny(Coda(optimizer_stream=on))
        opt = build_coda_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
        for _ in range(2):
            model(tokens, labels=tokens).backward()
            opt.step()
            opt.zero_grad()
        params[on] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params[False], params[True]))


def test_with_cuda_graphs_the_knob_is_refused_in_one_line():
    from coda_titan.titan.job_config import ConfigError

    job = SimpleNamespace(coda=Coda(optimizer_stream=True, cuda_graphs=True))
    dims = SimpleNamespace(fsdp_enabled=False, dp_replicate_enabled=False)
    with pytest.raises(ConfigError) as err:
        opt_stream.check(job, dims)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("[coda] optimizer_stream = true needs [coda] cuda_graphs = false"), msg
    opt_stream.check(SimpleNamespace(coda=Coda()), dims)  # (off: nothing to check)


@pytest.mark.parametrize("case", ["fsdp", "ddp"])
def test_under_fsdp_or_ddp_the_knob_is_turned_off_in_the_job_and_the_model_with_one_log_line(case, caplog):
    """A config tuned on one GPU runs sharded as it is: the step stays on the main stream (the forward's
    per-block waits need it there), in the job's [coda] and in the model's copy, which the optimizers read."""
    import logging

    job = SimpleNamespace(coda=Coda(optimizer_stream=True, step_chunk_layers=4))
    model = _tiny(Coda(optimizer_stream=True, step_chunk_layers=4))
    dims = SimpleNamespace(fsdp_enabled=case == "fsdp", dp_replicate_enabled=case == "ddp")
    with caplog.at_level(logging.INFO):
        opt_stream.check(job, dims, model)
    for coda in (job.coda, model.model_args.coda):
        assert (coda.optimizer_stream, coda.step_chunk_layers) == (False, 0)
    lines = [r.getMessage() for r in caplog.records if "optimizer_stream" in r.getMessage()]
    assert len(lines) == 1 and "off under FSDP2 / DDP" in lines[0], lines


def test_a_chunked_step_without_the_side_stream_is_refused_in_one_line():
    from coda_titan.titan.job_config import ConfigError

    dims = SimpleNamespace(fsdp_enabled=False, dp_replicate_enabled=False)
    with pytest.raises(ConfigError) as err:
        opt_stream.check(SimpleNamespace(coda=Coda(step_chunk_layers=4)), dims)
    assert "\n" not in str(err.value) and "needs [coda] optimizer_stream = true" in str(err.value)
    opt_stream.check(SimpleNamespace(coda=Coda(step_chunk_layers=4, optimizer_stream=True)), dims)


@pytest.mark.gpu
def test_training_with_the_step_on_its_own_stream_equals_training_without_it():
    """cute fp8, two 1B-width layers, compiled blocks, FA4, the fp8 weight pass prefetched by the step's
    post-hook: five steps with ``[coda] optimizer_stream``, and with it in chunks of one layer (``[coda]
    step_chunk_layers``: each block waits for its own chunk and weight pass), give, bit for bit, the
    losses and the final parameters and optimizer state of five steps without it (the same kernels in
    the same order on the same values; a forward or a weight pass that read a parameter before its
    update shows)."""
    seqlen = 1024
    # (FA4 as in the configs: its backward sums dQ, and with GQA dK and dV, in arrival order unless asked to be
    # deterministic; SDPA's cuDNN backward stays non-deterministic under warn_only)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        result = {on: _five_steps(on, seqlen) for on in (False, True, "chunked")}
    finally:
        torch.use_deterministic_algorithms(was)
    l0, p0, s0 = result[False]
    for on in (True, "chunked"):
        l1, p1, s1 = result[on]
        assert l0 == l1, (on, l0, l1)
        assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(torch.equal(a, b) for a, b in zip(s0, s1)), on


def _five_steps(on, seqlen: int):
    """Five training steps of the test above: (losses, parameters, optimizer state)."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    from .helpers import compiled_1b_width_model

    torch._dynamo.reset()
    coda = Coda(backend="cute", precision="fp8", optimizer_stream=bool(on), step_chunk_layers=int(on == "chunked"))
    model = compiled_1b_width_model(coda, seqlen, fa4=True)
    opt = build_coda_optimizers([model], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
    if on == "chunked":  # each chunk's end held back on the step's stream: a block that did not wait for its
        hooks, real = model.optimizer_stream, model.optimizer_stream.chunk_done  # chunk reads stale weights

        def slow(first):
            if hooks.main is not None:
                torch.cuda._sleep(20_000_000)
            real(first)

        hooks.chunk_done = slow
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(5):
        tokens = torch.randint(0, 128256, (2, seqlen), generator=g, device="cuda")
        loss = model(tokens, labels=tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())  # (the next step's batch follows a synchronizing read, as in TorchTitan)
    model.state_dict()  # (its pre-hook orders the main stream after the last step, as a checkpoint's does)
    # (in the parameters' order: a chunked first step creates the state in the chunks' order)
    state = [v.clone() for o in opt.optimizers for p in model.parameters() for v in o.state[p].values() if torch.is_tensor(v)]
    return losses, [p.detach().clone() for p in model.parameters()], state
