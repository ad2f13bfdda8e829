"""Probe (GPU): torch's fused AdamW against ``[coda] coda_adamw`` (``coda_titan/kernels/adamw.py``) on the 1B
model's parameters (bf16, shapes read off the model), as the training step runs them: the whole step at once
and in ``step_chunk_layers = 4`` chunks, without and with a ``grad_scale`` (``[coda] fused_clip``'s).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.adamw        (gpu_train.sh adamwprobe)

Timing: ``REPS`` steps enqueued back to back behind a GPU sleep long enough for the host to get ahead (the GPU's
ms per step between two events; the host's ms to enqueue a step beside it), 3 alternations of the arms, after 2
untimed steps each; the kernel also at other (block, warps) shapes (``SHAPES``). Bits: from the same state, 3 steps
of the kernel against torch's on the first two layers' shapes, fp32 and bf16, the elements apart per state tensor
(0 is the claim), the elements that
differ per tensor kind. Writes ``$OUT/probe_adamw_<gpu>.json``.
"""

from __future__ import annotations

import time

import torch

from coda_titan.kernels import adamw as kernel
from coda_titan.titan import coda_adamw
from scripts.bench.common import header, log_row, out_json
from scripts.bench.floor import _model

REPS = 10
# (elements a program, warps); the first: the default
SHAPES = ((2048, 4), (4096, 8), (8192, 8), (16384, 8), (8192, 16), (1024, 4))
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=True)


def _params(shapes, gen):
    ps = [torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
    return ps


def _optimizer(params, coda: bool):
    opt = torch.optim.AdamW(params, **HYPER)
    if coda:
        coda_adamw.install(opt)
    return opt


def _chunks(n_params: int, names: list[str], per_chunk: int = 4) -> list[list[int]]:
    """The parameter indices of each chunk of ``opt_stream.chunk_plan`` (embedding and norms, layer chunks, head)."""
    keys: dict[int, list[int]] = {}
    for i, name in enumerate(names):
        parts = name.split(".")
        key = int(parts[1]) // per_chunk if parts[0] == "layers" and len(parts) > 3 and "norm" not in parts[2] else (
            10**6 if parts[0] == "output" else -1)
        keys.setdefault(key, []).append(i)
    return [keys[k] for k in sorted(keys)]


def _stepper(opt, chunks, scale, shape=None):
    groups = opt.param_groups

    def step():
        if shape is not None:
            kernel.BLOCK, kernel.WARPS = shape
        if scale is not None:
            opt.grad_scale = scale
        if chunks is None:
            opt.step()
            return
        for idx in chunks:
            opt.param_groups = [dict(groups[0], params=[groups[0]["params"][i] for i in idx])]
            type(opt).step(opt)
        opt.param_groups = groups

    return step


def _timed(fn) -> dict:
    fn(), fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))
    a.record()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / REPS
    b.record()
    b.synchronize()
    return {"gpu_ms": a.elapsed_time(b) / REPS, "host_ms": host}


def _bits(shapes) -> list[dict]:
    """Elements apart from torch's fused AdamW after 3 steps (the last with a grad_scale), fp32 and bf16."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(1)
        ref = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(shapes, g)]
        ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
        o_ref, o_ours = _optimizer(ref, False), _optimizer(ours, True)
        diff = {"p": 0, "exp_avg": 0, "exp_avg_sq": 0, "grad": 0, "step": 0}
        for it in range(3):
            for a, b in zip(ref, ours):
                a.grad = (torch.randn(a.shape, device="cuda", generator=g) * 1e-3).to(a.dtype)
                b.grad = a.grad.clone()
            scale = torch.tensor(1.25, device="cuda") if it == 2 else None
            _stepper(o_ref, None, scale)(), _stepper(o_ours, None, scale)()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        for a, b in zip(ref, ours):
            sa, sb = o_ref.state[a], o_ours.state[b]
            diff["p"] += int((a.view(bits) != b.view(bits)).sum())
            diff["grad"] += int((a.grad.view(bits) != b.grad.view(bits)).sum())
            for k in ("exp_avg", "exp_avg_sq", "step"):
                diff[k] += int((sa[k].view(torch.int32 if k == "step" else bits) != sb[k].view(
                    torch.int32 if k == "step" else bits)).sum())
        rows.append({"dtype": str(dtype), "elements": sum(p.numel() for p in ref), "steps": 3, "differing": diff})
        del ref, ours, o_ref, o_ours
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    path = out_json("probe_adamw")
    a, _, shapes = _model("1B")
    from coda_titan.model.model import CodaTransformer

    with torch.device("meta"):
        names = [n for n, _ in CodaTransformer(a).named_parameters()]
    doc = {"kind": "probe_adamw", **header(), "model": "1B", "params": sum(torch.Size(s).numel() for s in shapes),
           "tensors": len(shapes), "dtype": "bfloat16", "hyper": {k: v for k, v in HYPER.items()},
           "timing": f"{REPS} steps back to back behind a GPU sleep: GPU ms per step, host ms to enqueue one",
           "bits": [], "results": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    small = [s for s, n in zip(shapes, names) if n.startswith(("layers.0.", "layers.1.", "norm"))]
    for row in _bits(small):
        log_row(doc, "bits", row, path)
    params = _params(shapes, gen)
    chunks = _chunks(len(params), names)
    scale = torch.tensor(1.0, device="cuda")
    arms = {}
    for coda in (False, True):
        opt = _optimizer(params, coda)
        for chunked in (False, True):
            for scaled in (False, True):
                arms[(coda, chunked, scaled, SHAPES[0])] = _stepper(opt, chunks if chunked else None,
                                                                    scale if scaled else None, SHAPES[0])
        for shape in SHAPES[1:] if coda else ():
            arms[(coda, True, True, shape)] = _stepper(opt, chunks, scale, shape)
    times = {k: [] for k in arms}
    for _ in range(3):
        for k, fn in arms.items():
            times[k].append(_timed(fn))
    moved = 2 * doc["params"] * 7  # (bytes: p, g, m, v read, p, m, v written; + g written with a scale)
    kernel.BLOCK, kernel.WARPS = SHAPES[0]
    for (coda, chunked, scaled, shape), ts in times.items():
        gpu = sorted(t["gpu_ms"] for t in ts)[1]
        row = {"optimizer": "coda" if coda else "torch_fused", "chunks": len(chunks) if chunked else 1,
               "grad_scale": scaled, **({"block": shape[0], "warps": shape[1]} if coda else {}),
               "gpu_ms": [t["gpu_ms"] for t in ts], "host_ms": [t["host_ms"] for t in ts],
               "gpu_median_ms": gpu, "host_median_ms": sorted(t["host_ms"] for t in ts)[1],
               "gb_per_s": (moved + (2 * doc["params"] if scaled else 0)) / gpu / 1e6}
        log_row(doc, "results", row, path)


if __name__ == "__main__":
    main()
