"""Benchmark (GPU): the physical floor of one training step, the number every step time is read against.

    source .gpu/part2/activate.sh && python3 -m scripts.bench.floor [--model 1B] [--seq-len 8192] [--batch 2]

The floor is what the step cannot do without, each piece at its best bare speed on this GPU:

* every GEMM of the step (per layer: QKV, out, W13 = gate and up, W2 = down; forward, dgrad, wgrad;
  and the LM head's three), bf16 at the faster of cuBLAS (``torch.mm``) and quack (autotuned), in
  the operand layouts the step has (forward: both K-major; dgrad: the weight N-major; wgrad: both
  operands token-major); fp8 at the fastest of cuBLAS ``_scaled_mm`` (slow and fast accumulation) and
  quack, on K-major e4m3 operands (e5m2 for the gradient), the layout SM90 fp8 MMAs read;
* FlashAttention-4 forward + backward, causal, on contiguous q, k, v;
* the AdamW step over the model's parameters, the faster of torch's fused kernel (TorchTitan's default
  implementation) and ``[coda] coda_adamw``'s (the same bits),
  in the training dtype.

Each piece is timed alone, a short burst on a GPU that has idled. A step runs its kernels back to back
at the power cap (680-700 W on the H100, every config alike) and at lower clocks, so with
``--cap-reps N`` (default 10) the best call of every piece then runs in a step's order, pass after pass,
and ``capped_floor_ms`` is a pass's GPU time there: the floor a step at the cap can reach.

bf16 floor = layer GEMMs + LM head + FA4 + AdamW; fp8 floor = fp8 layer GEMMs + bf16 LM head (as
TorchTitan's float8 recipe) + FA4 + AdamW. Elementwise work (norms, SwiGLU, RoPE, casts), the loss
and the idle gaps between kernels are not in it: a step at the floor has fused all of them away.
Every timing is the median of triton's do_bench after one untimed call, on random (never zero)
inputs. Writes ``$OUT/floor_<gpu>_<date>.json`` (default ``benchmarks/results``);
``scripts.compare`` embeds it in a comparison run later in the same lease (the same ``host_id``), and the
tables put step / floor beside every config.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

from .common import BF, bench, header, synced_ms, try_bench


def _model(model: str):
    """(args, FFN hidden size, every parameter's shape) of the flavor, read off the model built on
    the meta device (the FFN size as TorchTitan derives it, no copy of its formula)."""
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer

    a = coda_llama3_args[model]
    with torch.device("meta"):
        params = dict(CodaTransformer(a).named_parameters())
    return a, params["layers.0.feed_forward.w1.weight"].shape[0], [tuple(p.shape) for p in params.values()]


def layer_gemms(d: int, ff: int, hq: int, hkv: int, hd: int, vocab: int) -> list[tuple[str, int, int]]:
    """(name, N_out, K_in) of each weight of the step, the LM head last: y = x @ W^T, W (N, K)."""
    return [("qkv", (hq + 2 * hkv) * hd, d), ("out", d, hq * hd), ("w13", 2 * ff, d), ("w2", d, ff),
            ("lm_head", vocab, d)]


def _rand(*shape, dtype=BF, scale=1.0, gen=None):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def _generator():
    return torch.Generator(device="cuda").manual_seed(0)


def _best(times: dict) -> tuple[str, float]:
    ok = {k: v for k, v in times.items() if v is not None}
    k = min(ok, key=ok.get)
    return k, ok[k]


QUACK_TUNED = True  # --quack default: quack's own heuristic config for a bare GEMM (no sweep)


def bf16_gemm(m: int, n: int, k: int, gen) -> list[dict]:
    """Forward, dgrad and wgrad of W (n, k) on m tokens, cuBLAS and quack, in the step's layouts."""
    from quack.gemm_interface import gemm as qgemm

    x, w, dy = _rand(m, k, gen=gen), _rand(n, k, scale=k**-0.5, gen=gen), _rand(m, n, scale=1e-2, gen=gen)
    cases = {  # (A (rows, K) view, B (K, cols) view)
        "fwd": (x, w.t()),
        "dgrad": (dy, w),
        "wgrad": (dy.t(), x),
    }
    rows = []
    for direction, (a, b) in cases.items():
        fns = {"cublas": lambda a=a, b=b: torch.mm(a, b), "quack": lambda a=a, b=b: qgemm(a, b, tuned=QUACK_TUNED)}
        t = {k: try_bench(f) for k, f in fns.items()}
        best, ms = _best(t)
        rows.append({"direction": direction, "M": a.shape[0], "N": b.shape[1], "K": a.shape[1], "ms": t,
                     "best": best, "best_ms": ms, "tflops": 2 * a.shape[0] * b.shape[1] * a.shape[1] / ms / 1e9,
                     "_fn": fns[best]})
        torch.cuda.empty_cache()
    return rows


def fp8_gemm(m: int, n: int, k: int, gen) -> list[dict]:
    """As ``bf16_gemm`` on fp8: e4m3 activations and weights, e5m2 gradients, all K-major."""
    from quack.gemm_interface import gemm as qgemm

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")
    x, w, dy = _rand(m, k, dtype=e4, gen=gen), _rand(n, k, dtype=e4, gen=gen), _rand(m, n, dtype=e5, gen=gen)
    cases = {  # (A (rows, K) K-major, B given as (cols, K) K-major)
        "fwd": (x, w),
        "dgrad": (dy, w.t().contiguous()),
        "wgrad": (dy.t().contiguous(), x.t().contiguous()),
    }
    rows = []
    for direction, (a, b) in cases.items():
        def sm(fast, a=a, b=b):
            return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=BF, use_fast_accum=fast)

        fns = {"cublas": sm(False), "cublas_fast_accum": sm(True),
               "quack": lambda a=a, b=b: qgemm(a, b.t(), out_dtype=BF, tuned=QUACK_TUNED)}
        t = {k: try_bench(f) for k, f in fns.items()}
        best, ms = _best(t)
        rows.append({"direction": direction, "M": a.shape[0], "N": b.shape[0], "K": a.shape[1], "ms": t,
                     "best": best, "best_ms": ms, "tflops": 2 * a.shape[0] * b.shape[0] * a.shape[1] / ms / 1e9,
                     "_fn": fns[best]})
        torch.cuda.empty_cache()
    return rows


def fa4(bs: int, seqlen: int, hq: int, hkv: int, hd: int, gen) -> dict:
    """FA4 forward + backward, causal, contiguous (bs, seq, heads, hd) q, k, v."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    q, k, v = (_rand(bs, seqlen, h, hd, gen=gen) for h in (hq, hkv, hkv))
    dout = _rand(bs, seqlen, hq, hd, gen=gen)
    scale = hd**-0.5
    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fns = {"fwd": lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True),
           "bwd": lambda: _flash_attn_bwd(q, k, v, out, dout, lse, scale, True, dq=dq, dk=dk, dv=dv)}
    fwd, bwd = bench(fns["fwd"]), bench(fns["bwd"])
    return {"fwd_ms": fwd, "bwd_ms": bwd, "ms": fwd + bwd, "_fns": fns}


def adamw(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> dict:
    """One AdamW step over parameters of these shapes: torch's fused (TorchTitan's default implementation) and
    ``[coda] coda_adamw``'s (the same bits, one Triton launch), the faster as the floor's."""
    from coda_titan.titan import coda_adamw

    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    ms, fns = {}, {}
    for name in ("torch_fused", "coda"):
        opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True)
        if name == "coda":
            coda_adamw.install(opt)
        opt.step()  # state allocated, as after a training step
        ms[name], fns[name] = bench(opt.step), opt.step
    best = min(ms, key=ms.get)
    n = sum(p.numel() for p in params)
    return {"ms": ms[best], "best": best, "by_optimizer_ms": ms, "params": n, "dtype": str(dtype), "_fn": fns[best]}


def measure(model: str, seqlen: int, bs: int, dtype: torch.dtype, save, cap_reps: int = 0) -> dict:
    a, ff, shapes = _model(model)
    hd = a.dim // a.n_heads
    m = seqlen * bs
    gen = _generator()
    doc = {**header(), "kind": "floor", "model": model, "seq_len": seqlen, "local_batch_size": bs, "tokens": m,
           "n_layers": a.n_layers, "timing": "triton.testing.do_bench median after one untimed call",
           "quack": "autotuned" if QUACK_TUNED else "default config (no sweep)", "complete": False, "gemms": []}
    kernels = {}  # (the best call of each piece, kept with its operands for the run at the cap only)
    for name, n, k in layer_gemms(a.dim, ff, a.n_heads, a.n_kv_heads, hd, a.vocab_size):
        precisions = ("bf16",) if name == "lm_head" else ("bf16", "fp8")
        for precision in precisions:
            rows = (bf16_gemm if precision == "bf16" else fp8_gemm)(m, n, k, gen)
            for r in rows:
                r.update(weight=name, precision=precision)
                fn = r.pop("_fn")
                if cap_reps:
                    kernels[(name, precision, r["direction"])] = fn
                print(f"  {name:8} {precision} {r['direction']:5} M {r['M']:6} N {r['N']:6} K {r['K']:6}: "
                      + " ".join(f"{p} {v:.3f}" if v else f"{p} -" for p, v in r["ms"].items())
                      + f" -> {r['best']} {r['tflops']:.0f} TFLOP/s", flush=True)
            doc["gemms"] += rows
            save(doc)  # a run cut short keeps what it measured ("complete": false)
    doc["fa4"] = fa4(bs, seqlen, a.n_heads, a.n_kv_heads, hd, gen)
    fa4_fns = doc["fa4"].pop("_fns")
    kernels["fa4_fwd"], kernels["fa4_bwd"] = fa4_fns["fwd"], fa4_fns["bwd"]
    print(f"  FA4 fwd {doc['fa4']['fwd_ms']:.3f} bwd {doc['fa4']['bwd_ms']:.3f} ms per layer", flush=True)
    doc["adamw"] = adamw(shapes, dtype)
    kernels["adamw"] = doc["adamw"].pop("_fn")
    if not cap_reps:
        kernels.clear()
        torch.cuda.empty_cache()
    opt = doc["adamw"]
    print(f"  AdamW {opt['ms']:.2f} ms ({opt['best']}) over {opt['params'] / 1e9:.3f} B params",
          flush=True)
    doc["totals"] = totals(doc)
    save(doc)
    if cap_reps:
        try:
            doc["at_cap"] = {p: at_cap(kernels, step_order(a.n_layers, p), cap_reps) for p in ("bf16", "fp8")}
        except torch.cuda.OutOfMemoryError as e:  # (every piece's operands at once: the isolated floor stands)
            doc["at_cap_error"] = f"OutOfMemoryError: {str(e)[:300]}"
        doc["totals"] = totals(doc)
    doc["complete"] = True
    return doc


def step_order(n_layers: int, precision: str) -> list:
    """The floor's pieces in a training step's order: each layer's forward (QKV, attention, out, W13, W2),
    the LM head's forward, its dgrad and wgrad, each layer's backward from the last (W2, W13, out, attention,
    QKV; dgrad then wgrad), the optimizer step. Keys of ``measure``'s kernels (the LM head in bf16 always)."""
    fwd = [("qkv", precision, "fwd"), "fa4_fwd", ("out", precision, "fwd"), ("w13", precision, "fwd"),
           ("w2", precision, "fwd")]
    bwd = [(w, precision, d) for w in ("w2", "w13", "out") for d in ("dgrad", "wgrad")]
    bwd += ["fa4_bwd", ("qkv", precision, "dgrad"), ("qkv", precision, "wgrad")]
    head = [("lm_head", "bf16", d) for d in ("fwd", "dgrad", "wgrad")]
    return fwd * n_layers + head + bwd * n_layers + ["adamw"]


STEP_PARTS = ("layer_gemms", "lm_head", "attention_fwd", "attention_bwd", "optimizer")
PART_PASSES = 3  # (passes timed call by call after the timed ones, at the cap: the median per part)


def part_of(key) -> str:
    """The part of the step (``STEP_PARTS``) a key of ``step_order`` belongs to."""
    if key == "adamw":
        return "optimizer"
    if key in ("fa4_fwd", "fa4_bwd"):
        return f"attention_{key[4:]}"
    return "lm_head" if key[0] == "lm_head" else "layer_gemms"


def parts_of_pass(order: list, call_ms: list[float]) -> dict[str, float]:
    """One pass's GPU ms per part of the step, from each call's ms (``order``'s keys, in order)."""
    if len(order) != len(call_ms):
        raise ValueError(f"{len(call_ms)} timings for {len(order)} calls")
    out = dict.fromkeys(STEP_PARTS, 0.0)
    for key, ms in zip(order, call_ms):
        out[part_of(key)] += ms
    return out


def timed_calls(calls: list) -> list[float]:
    """One pass of ``calls`` back to back with a CUDA event after each (one synchronization, at the end): each
    call's GPU ms, the gap before its kernels included."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
    events[0].record()
    for f, e in zip(calls, events[1:]):
        f()
        e.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def at_cap(kernels: dict, order: list, reps: int) -> dict:
    """The floor's kernels back to back in step order (``order``), as a step runs them at the power cap: GPU
    ms per pass (CUDA events) over ``reps`` passes after two untimed ones, with the SM clock and power
    ``nvidia-smi`` sampled meanwhile. The isolated timings above are each a short burst; this is the floor
    a step at the cap can reach, on these random operands (a GEMM's power depends on its operands' bits:
    a real step's, such as the LM head's near-zero softmax gradients, may draw less). Then ``PART_PASSES`` more
    passes with an event after each call give the median GPU ms per part of the step (``parts_ms``), at the cap:
    what each part of a profiled step is above its own capped floor."""
    import statistics
    import time

    from scripts.compare.gpu_clocks import ClockSampler, medians_between

    calls = [kernels[k] for k in order]

    def one_pass():
        for f in calls:
            f()

    for _ in range(2):
        one_pass()
    torch.cuda.synchronize()
    with ClockSampler() as clocks:
        t0 = time.time()
        ms = synced_ms(one_pass, reps)
        t1 = time.time()
        parts = [parts_of_pass(order, timed_calls(calls)) for _ in range(PART_PASSES)]  # (still at the cap)
    sm_mhz, power_w = medians_between(clocks.samples, t0, t1)
    out = {"ms": statistics.median(ms), "raw_ms": ms, "kernels": len(calls), "sm_mhz": sm_mhz, "power_w": power_w,
           "parts_ms": {k: statistics.median(p[k] for p in parts) for k in STEP_PARTS}}
    print(f"  at the cap: {out['ms']:.1f} ms a pass of {len(calls)} kernels, SM {out['sm_mhz']} MHz, "
          f"{out['power_w']} W; by part " + ", ".join(f"{k} {v:.1f}" for k, v in out["parts_ms"].items()), flush=True)
    return out


def totals(doc: dict) -> dict:
    """The floor per precision, and its parts, in ms per step; with ``at_cap`` (``--cap-reps``), the same
    kernels back to back in step order (``capped_floor_ms``)."""
    nl = doc["n_layers"]
    best = {(g["weight"], g["precision"], g["direction"]): g["best_ms"] for g in doc["gemms"]}
    layer = ("qkv", "out", "w13", "w2")
    dirs = ("fwd", "dgrad", "wgrad")
    head = sum(best[("lm_head", "bf16", d)] for d in dirs)
    attn, opt = nl * doc["fa4"]["ms"], doc["adamw"]["ms"]
    out = {}
    for precision in ("bf16", "fp8"):
        gemms = nl * sum(best[(w, precision, d)] for w in layer for d in dirs)
        out[precision] = {"layer_gemms_ms": gemms, "lm_head_ms": head, "attention_ms": attn, "optimizer_ms": opt,
                          "floor_ms": gemms + head + attn + opt}
        if precision in doc.get("at_cap", {}):
            out[precision]["capped_floor_ms"] = doc["at_cap"][precision]["ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1B")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", help="the parameters' dtype (the configs' training.dtype)")
    ap.add_argument("--quack", choices=("tuned", "default"), default="tuned",
                    help="quack autotuned (about 30 s per shape) or its default config for a bare GEMM")
    ap.add_argument("--cap-reps", type=int, default=10,
                    help="then N passes of the floor's kernels back to back in step order, at the power cap (0: none)")
    args = ap.parse_args(argv)
    global QUACK_TUNED
    QUACK_TUNED = args.quack == "tuned"
    torch.backends.cuda.matmul.allow_tf32 = False
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    tag = "" if args.model == "1B" else f"{args.model.lower()}_"

    def save(doc):
        slug = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
        path = os.path.join(out_dir, f"floor_{tag}{slug}_{doc['date']}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return path

    doc = measure(args.model, args.seq_len, args.batch, getattr(torch, args.dtype), save, args.cap_reps)
    for p, t in doc["totals"].items():
        print(f"{p} floor {t['floor_ms']:.1f} ms = layer GEMMs {t['layer_gemms_ms']:.1f} + LM head {t['lm_head_ms']:.1f} "
              f"+ FA4 {t['attention_ms']:.1f} + AdamW {t['optimizer_ms']:.1f}"
              + (f"; back to back at the cap {t['capped_floor_ms']:.1f} ms" if "capped_floor_ms" in t else ""), flush=True)
    print("wrote", save(doc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
