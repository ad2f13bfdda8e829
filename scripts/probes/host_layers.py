"""Probe (GPU): the host time of one call of each CODA program, split by the layer it passes through.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.host_layers [--precision fp8 bf16] [--d 2048]

Why: the 1B fp8 step is host-bound (``compare_pin_memory_fp8_…json``: the host spends about 193 ms
enqueueing a step whose GPU work takes about 215; ``probe_host_slack_…json``: the forward's GPU span
shrinks from 58 to 46 ms once the host is ahead), and ``probe_host_profile_…json`` put most of a
program's host time in torch's custom-op wrapper (``backend_impl``) under cProfile, whose own time
cannot say which code it is. This probe times wall clock, without a profiler, one layer peeled at a time:

* ``op``: the program as the model calls it (``torch.ops.coda.<name>``: the dispatcher, the custom op's
  autograd and backend wrappers, its aliasing check);
* ``backend``: the registered CUDA kernel as the custom op stores it (``_backend_fns['cuda']``, inside
  ``torch._disable_dynamo``), called with the same arguments;
* ``kernel``: our CUDA kernel function itself (checks, allocations, the quack call, small aten ops);
* ``quack``: quack's epilogue-GEMM frontend call(s) that kernel made, replayed with the same arguments.

Each is timed as ``--calls`` calls enqueued behind a long ``torch.cuda._sleep`` (the enqueue never waits
for the GPU; ``host_overhead.host_us``). Writes ``$OUT/probe_host_layers_<gpu>.json``.
"""

from __future__ import annotations

import contextlib

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.host_overhead import host_us, probe_args, programs


def _coda_opdefs() -> dict:
    from torch._library.custom_ops import OPDEFS

    return {name: op for name, op in OPDEFS.items() if name.startswith("coda::") and "cuda" in op._backend_fns}


def _inner(wrapped):
    """Our kernel function inside the custom op's ``wrapped_fn`` (``torch._disable_dynamo`` keeps it
    as ``__wrapped__``; ``wrapped_fn`` holds it in its closure as ``fn``)."""
    inner = getattr(wrapped, "__wrapped__", wrapped)
    for name, cell in zip(inner.__code__.co_freevars, inner.__closure__ or ()):
        if name == "fn":
            return cell.cell_contents
    return None


@contextlib.contextmanager
def recording(calls: list, quack_calls: list):
    """Record every coda CUDA backend call (op name, args, kwargs) and every quack frontend call made
    under it, by wrapping the custom ops' stored backends and the frontend class's ``__call__``."""
    from quack.epilogue.library import rms_partial_epi

    ops = _coda_opdefs()
    saved = {name: op._backend_fns["cuda"] for name, op in ops.items()}
    # (the epilogue modules' class only: quack's kernel classes have jitted __call__s a wrapper would break)
    cls = next(c for c in type(rms_partial_epi).__mro__ if "__call__" in vars(c))
    call = cls.__call__

    def wrap_op(name, fn):
        def w(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return w

    def wrapped_call(self, *args, **kwargs):
        quack_calls.append((call, self, args, kwargs))
        return call(self, *args, **kwargs)

    for name, op in ops.items():
        op._backend_fns["cuda"] = wrap_op(name, saved[name])
    cls.__call__ = wrapped_call
    try:
        yield
    finally:
        for name, op in ops.items():
            op._backend_fns["cuda"] = saved[name]
        cls.__call__ = call


def layers(fn, calls: int) -> dict:
    """Host us per program call at each layer (``None`` where the layer could not be reached)."""
    rec, qrec = [], []
    with recording(rec, qrec):
        fn()
    torch.cuda.synchronize()
    ops = _coda_opdefs()
    backends = [(ops[name]._backend_fns["cuda"], a, k) for name, a, k in rec]
    kernels = [(_inner(ops[name]._backend_fns["cuda"]), a, k) for name, a, k in rec]
    out = {"ops": [name for name, _, _ in rec], "quack_calls": len(qrec)}
    out["op_us"], out["op_syncs"] = host_us(fn, calls)
    out["backend_us"], _ = host_us(lambda: [b(*a, **k) for b, a, k in backends], calls)
    if all(f is not None for f, _, _ in kernels):
        out["kernel_us"], _ = host_us(lambda: [f(*a, **k) for f, a, k in kernels], calls)
    if qrec:
        out["quack_us"], _ = host_us(lambda: [f(s, *a, **k) for f, s, a, k in qrec], calls)
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def main(argv=None) -> int:
    args = probe_args("scripts.probes.host_layers", __doc__, argv, precisions=("fp8", "bf16"))
    path = out_json("probe_host_layers")
    doc = {**header(), "kind": "probe_host_layers",
           "timing": "host us per program call, enqueued behind torch.cuda._sleep, at each layer: op (torch.ops.coda), "
                     "backend (the custom op's stored CUDA kernel), kernel (our function), quack (its frontend calls)",
           "rows": []}
    for precision, setup, program in programs(args.precision, args.d):
        op, direction, fns = program(setup)
        fn = fns.get("coda")
        if fn is None:
            continue
        try:
            row = {"program": op, "direction": direction, "precision": precision, "d": setup.d, **layers(fn, args.calls)}
        except Exception as e:  # noqa: BLE001 - a probe row that fails says why and the rest go on
            row = {"program": op, "direction": direction, "precision": precision, "d": setup.d,
                   "error": f"{type(e).__name__}: {e}"[:300]}
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
