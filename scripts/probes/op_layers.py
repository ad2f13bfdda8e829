"""Probe (GPU): what torch's custom-op layer costs per call of a CODA program, and what a leaner
registration of the same kernel would cost, on the GPU host's torch.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.op_layers [--d 2048] [--calls 200]

Why: ``probe_host_layers_…json`` has the op (``torch.ops.coda``) 40-100 us a call above its stored CUDA
backend for the fp8 programs, where the same layers cost about 7 us on the CPU machine's torch 2.13
(the forward is host-bound: ``probe_host_slack_…json``). Per recorded program call (``host_layers``'
recording) this times, host only, enqueued behind a GPU sleep (``host_overhead.host_us``):

* ``op_us``: ``torch.ops.coda.<name>.default`` as the compiled graph calls it;
* ``below_autograd_us``: the same inside ``_AutoDispatchBelowAutograd`` (the dispatcher skips the
  Autograd key: what the custom op's Python autograd kernel adds is op_us minus this);
* ``backend_us``: the stored backend (``_backend_fns['cuda']``: our kernel inside ``_disable_dynamo``);
* ``kernel_us``: our kernel function itself;
* ``alias_check_us``: torch's output-aliasing check on that call's inputs and outputs;
* ``lean_us``: the op again after the CUDA key is re-registered to our kernel inside
  ``_disable_dynamo`` with no check (a Library of ours, ``allow_override``), the Autograd key as is.

Also stores the source of this torch's ``backend_impl`` and ``autograd_impl``. Writes
``$OUT/probe_op_layers_<gpu>.json``.
"""

from __future__ import annotations

import inspect

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.host_layers import _coda_opdefs, _inner, recording
from scripts.probes.host_overhead import host_us, probe_args, programs


def _alias_check():
    from torch._library import utils

    check = getattr(utils, "_c_check_aliasing_constraint", None)
    if check is not None:
        return lambda name, a, k, out: check(name, a, k, out)
    return lambda name, a, k, out: utils.check_aliasing_constraint(name, utils.iter_tensors(a, k), out)


def _sources() -> dict:
    from torch._library import autograd, custom_ops

    out = {}
    for label, obj in (("custom_ops.CustomOpDef.register_kernel", custom_ops.CustomOpDef.register_kernel),
                       ("autograd.make_autograd_impl", autograd.make_autograd_impl)):
        try:
            out[label] = inspect.getsource(obj)[:6000]
        except (OSError, TypeError) as e:
            out[label] = f"unavailable: {e}"
    return out


def _row(name: str, args, kwargs, calls: int, lib) -> dict:
    opdef = _coda_opdefs()[name]
    overload = getattr(torch.ops.coda, name.split("::")[1]).default
    backend = opdef._backend_fns["cuda"]
    kernel = _inner(backend)
    row = {"op": name}
    row["op_us"], _ = host_us(lambda: overload(*args, **kwargs), calls)

    def below():
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)

    row["below_autograd_us"], _ = host_us(below, calls)
    row["backend_us"], _ = host_us(lambda: backend(*args, **kwargs), calls)
    if kernel is not None:
        row["kernel_us"], _ = host_us(lambda: kernel(*args, **kwargs), calls)
    out = overload(*args, **kwargs)
    check = _alias_check()
    row["alias_check_us"], _ = host_us(lambda: check(name, args, kwargs, out if isinstance(out, tuple) else (out,)),
                                       calls)
    if kernel is not None:
        lean = torch._disable_dynamo(kernel)
        lib.impl(name.split("::")[1], lean, "CUDA", allow_override=True)
        row["lean_us"], _ = host_us(lambda: overload(*args, **kwargs), calls)
        lib.impl(name.split("::")[1], backend, "CUDA", allow_override=True)  # (the stored backend again, checks aside)
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def main(argv=None) -> int:
    args = probe_args("scripts.probes.op_layers", __doc__, argv, precisions=("fp8",))
    path = out_json("probe_op_layers")
    doc = {**header(), "kind": "probe_op_layers", "timing": "host us per call, enqueued behind torch.cuda._sleep",
           "sources": _sources(), "rows": []}
    lib = torch.library.Library("coda", "IMPL")
    seen = set()
    for precision, setup, program in programs(args.precision, args.d):
        op, direction, fns = program(setup)
        fn = fns.get("coda")
        if fn is None or direction != "fwd":
            continue
        rec, qrec = [], []
        with recording(rec, qrec):
            fn()
        torch.cuda.synchronize()
        for name, a, k in rec:
            if name in seen:
                continue
            seen.add(name)
            try:
                row = {"program": op, "precision": precision, **_row(name, a, k, args.calls, lib)}
            except Exception as e:  # noqa: BLE001 - a probe row that fails says why and the rest go on
                row = {"program": op, "op": name, "error": f"{type(e).__name__}: {e}"[:400]}
            log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
