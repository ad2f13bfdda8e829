"""Probe (GPU): where a run's reserved memory sits, by CUDA stream, when its last step is done.

Why: the README's peak memory is the caching allocator's reserved peak. Under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` float8 + compile's reserved memory is its live peak plus
0.24 GiB, CODA fp8's its warm-up live peak plus 2.0 (docs/fp8.md, sixty-ninth session). The allocator keeps one pool per
stream: memory freed on one stream is not handed to another. CODA allocates on three streams besides the main one
(``[coda] optimizer_stream``'s step, the fp8 weight pass's ``_side_stream``, ``input_stream``'s copies), so their
pools are the candidate for that gap.

Method: ``scripts.compare`` runs every one-process config through ``scripts.probes.step_phases``' wrapper of
TorchTitan's Trainer; after the last step it calls :func:`record`, which reads ``torch.cuda.memory_snapshot()``
once (after the timed steps: it costs no step time) and sums its segments by stream: reserved, allocated (live
tensors between steps) and the largest free block. Reserved memory only grows unless something empties the cache,
so at the end it is the run's reserved peak (the stats' ``*_peak_gib`` are since TorchTitan's last reset, at its
last metrics line). The streams are named from the Trainer (``main``: the stream current
after the step; ``optimizer``, ``weight_pass``, ``input``; any other: ``other``). ``scripts.compare`` keeps the
result in each run's ``alloc_streams``.
"""

from __future__ import annotations

GIB = 2**30


def stream_names(trainer, current: int) -> dict[int, str]:
    """CUDA stream handle -> name, for the streams this plug-in makes (``current``: the main stream's handle)."""
    names = {current: "main"}
    parts = getattr(trainer, "model_parts", None) or [None]
    found = (("optimizer", getattr(getattr(parts[0], "optimizer_stream", None), "stream", None)),
             ("weight_pass", getattr(parts[0], "_side_stream", None)),
             ("input", getattr(getattr(trainer, "_coda_input_stream", None), "stream", None)))
    for name, stream in found:
        if stream is not None:
            names.setdefault(stream.cuda_stream, name)
    return names


def by_stream(segments: list[dict], names: dict[int, str]) -> list[dict]:
    """The snapshot's segments summed per stream (GiB), the largest reserved first."""
    per: dict[int, dict] = {}
    for seg in segments:
        s = per.setdefault(seg["stream"], {"stream": names.get(seg["stream"], "other"), "handle": seg["stream"],
                                           "segments": 0, "reserved": 0, "allocated": 0, "largest_free": 0})
        s["segments"] += 1
        s["reserved"] += seg["total_size"]
        s["allocated"] += seg["allocated_size"]
        free = [b["size"] for b in seg.get("blocks", []) if b.get("state") == "inactive"]
        s["largest_free"] = max([s["largest_free"], *free])
    rows = sorted(per.values(), key=lambda s: -s["reserved"])
    for s in rows:
        for k in ("reserved", "allocated", "largest_free"):
            s[k + "_gib"] = round(s.pop(k) / GIB, 3)
    return rows


def record(trainer) -> dict:
    """The allocator's state by stream now (empty without CUDA); an error is recorded, not raised."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        names = stream_names(trainer, torch.cuda.current_stream().cuda_stream)
        return {"streams": by_stream(torch.cuda.memory_snapshot(), names),
                **{f"{k.split('_')[0]}_{s}_gib": round(stats[f"{k}.all.{s}"] / GIB, 3)
                   for k in ("reserved_bytes", "active_bytes") for s in ("current", "peak")}}
    except Exception as e:  # (a probe: the run's numbers stand without it)
        return {"error": f"{type(e).__name__}: {e}"}
