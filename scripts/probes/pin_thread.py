"""Probe (CPU): the Python work the data loader's pin-memory thread does per batch, on the configs' data.

    python -m scripts.probes.pin_thread [--batches 60] [--seq-len 8192] [--batch 2]

Why: the 1B configs load data with TorchTitan's ``StatefulDataLoader`` (``num_workers = 1``,
``pin_memory = true``). Its worker sends every batch with the dataset's state (``snapshot_every_n_steps``
is 1), and TorchTitan's text dataset keeps its leftover tokens in that state as a Python list
(``token_buffer``). The main process's pin-memory thread runs torch's ``pin_memory`` over the whole
message, recursing into that list one Python call per token while it holds the GIL. In the profiled
CODA fp8 forward of 2026-11-27 (``traces/trace_llama3_1b_fp8_coda_compile_…``, cProfile of the
``hostslack`` probe) that function ran 10,280 times inside one forward, on a step whose forward host
time (57.7 ms) matched its GPU time (58.1 ms).

Method: TorchTitan's ``HuggingFaceTextDataset`` on ``coda_stdlib`` with the configs' tokenizer and
sequence length; after each batch (``--batch`` samples) the dataset's state is timed through torch's
``pin_memory`` (no tensor in it: the Python recursion alone, which is what holds the GIL; the batch's
own two tensors are pinned in C). Writes ``$OUT/probe_pin_thread_cpu.json`` (benchmarks/results without
$OUT): per batch the buffer's length and the time; their medians, the time's mean and maximum. The
time is this machine's CPU's, not the GPU host's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def measure(batches: int, seq_len: int, batch: int, spec: str = "coda:stdlib-bpe-8192") -> dict:
    from torch.utils.data._utils.pin_memory import pin_memory
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from coda_titan.titan.data import EMBEDDED_DATASET, ensure_tokenizer, register_datasets

    register_datasets()
    ds = HuggingFaceTextDataset(EMBEDDED_DATASET, None, HuggingFaceTokenizer(ensure_tokenizer(spec)), seq_len=seq_len)
    it = iter(ds)
    rows = []
    for _ in range(batches):
        for _ in range(batch):
            next(it)
        state = ds.state_dict()
        t0 = time.perf_counter()
        pin_memory(state)
        rows.append({"token_buffer": len(state["token_buffer"]), "pin_python_ms": (time.perf_counter() - t0) * 1e3})
    return {"batches": rows,
            "median_token_buffer": statistics.median(r["token_buffer"] for r in rows),
            "median_pin_python_ms": statistics.median(r["pin_python_ms"] for r in rows),
            "mean_pin_python_ms": statistics.mean(r["pin_python_ms"] for r in rows),
            "max_pin_python_ms": max(r["pin_python_ms"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.pin_thread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2, help="samples a batch (the configs' local_batch_size)")
    args = ap.parse_args(argv)
    import platform

    import torch

    doc = {"kind": "probe_pin_thread", "device": "cpu", "cpu": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d"), "versions": {"torch": torch.__version__},
           "seq_len": args.seq_len, "local_batch_size": args.batch, **measure(args.batches, args.seq_len, args.batch)}
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "probe_pin_thread_cpu.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"token buffer median {doc['median_token_buffer']:.0f} tokens; pin_memory's Python per batch median "
          f"{doc['median_pin_python_ms']:.2f} ms, mean {doc['mean_pin_python_ms']:.2f}, "
          f"max {doc['max_pin_python_ms']:.2f} ms; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
