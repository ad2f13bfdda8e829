"""Timing helpers and the shared inputs of the kernel benchmark (random, never zeros)."""

from __future__ import annotations

import datetime
import functools

import torch

M = 16384
VOCAB = 128256
# LLaMA-3 shapes at each hidden size: (ffn hidden, q heads, kv heads, head_dim)
SHAPES = {2048: (8192, 32, 8, 64), 4096: (14336, 32, 8, 128), 8192: (28672, 64, 8, 128)}
EPS = 1e-5
SEQLEN = 8192
BF = torch.bfloat16


def _on_cpu(cpu: bool | None) -> bool:
    """A result measured on the CPU: as asked, else where CUDA is absent."""
    return not torch.cuda.is_available() if cpu is None else cpu


def header(cpu: bool | None = None) -> dict:
    """device, host (``host_id``: which lease), date and versions: the first keys of every kernel result file
    (quack's version None where it is not installed: a probe of torch kernels alone; device "CPU" without CUDA,
    or ``cpu``: a probe's CPU mode)."""
    from scripts.compare.common import host_id

    try:
        import quack
    except ImportError:
        quack = None
    return {
        "device": "CPU" if _on_cpu(cpu) else torch.cuda.get_device_name(),
        "host": host_id(),
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "quack": getattr(quack, "__version__", "?") if quack else None,
                     "cuda": torch.version.cuda},
    }


def out_json(name: str, cpu: bool | None = None) -> str:
    """``$OUT/<name>_<gpu>.json`` (``_cpu.json`` without CUDA; benchmarks/results without $OUT), its folder created."""
    import os

    from scripts.compare.common import _slug

    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    gpu = "cpu" if _on_cpu(cpu) else _slug(torch.cuda.get_device_name())
    return os.path.join(out_dir, f"{name}_{gpu}.json")


def log_row(doc: dict, key: str, row: dict, path: str) -> None:
    """Append ``row`` to ``doc[key]``, print it as one JSON line and rewrite ``path`` (a call cut
    short keeps every row measured so far)."""
    import json

    doc[key].append(row)
    print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def synced_ms(fn, reps: int) -> list[float]:
    """GPU ms of each of ``reps`` calls of ``fn``, each between two CUDA events and synced (its host time counts)."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def at_cap(fn, seconds: float) -> dict:
    """Calls of ``fn`` back to back for ``seconds`` (a step's power cap, not a short burst): the GPU's ms per
    call over the second half (the first brings the GPU to its steady state), the calls timed, and the SM
    clock and power ``nvidia-smi`` sampled over that half (None without it)."""
    import time

    from scripts.compare.gpu_clocks import ClockSampler, medians_between

    with ClockSampler() as clocks:
        t_end = time.perf_counter() + seconds / 2
        while time.perf_counter() < t_end:
            for _ in range(8):
                fn()
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0, calls = time.time(), 0
        a.record()
        t_end = time.perf_counter() + seconds / 2
        while time.perf_counter() < t_end:
            for _ in range(8):
                fn()
            calls += 8
            b.record()
            b.synchronize()
        t1 = time.time()
    sm_mhz, power_w = medians_between(clocks.samples, t0, t1)
    return {"sustained_ms": a.elapsed_time(b) / calls, "calls": calls, "sm_mhz": sm_mhz, "power_w": power_w}


def graphed(fn, doc: dict, arm: str):
    """``fn`` captured as one CUDA graph (returns its replay: no host time between the calls ``at_cap`` times),
    or ``fn`` itself where capture fails; ``doc["graphed"][arm]`` says which (True, or the error)."""
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        doc.setdefault("graphed", {})[arm] = True
        return g.replay
    except Exception as e:  # noqa: BLE001 - time it eagerly, and say why
        doc.setdefault("graphed", {})[arm] = f"{type(e).__name__}: {str(e)[:200]}"
        return fn


def arms_at_cap(doc: dict, arms: dict, path: str, seconds: float, rounds: int) -> None:
    """Each arm (name -> fn) graphed, then timed ``at_cap`` in turn for ``rounds`` rounds (rows logged to ``path``),
    and ``doc["median_ms_<arm>"]`` the median of its rounds."""
    arms = {arm: graphed(fn, doc, arm) for arm, fn in arms.items()}
    for r in range(rounds):
        for arm, fn in arms.items():
            log_row(doc, "rows", {"round": r, "arm": arm, **at_cap(fn, seconds)}, path)
    for arm in arms:
        ts = sorted(row["sustained_ms"] for row in doc["rows"] if row.get("arm") == arm)
        doc[f"median_ms_{arm}"] = ts[len(ts) // 2]


def bench(fn, reps=None):
    """Median ms of triton's do_bench, after one untimed call (compile / autotune / allocate)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200 if reps is None else reps, return_mode="median")


def try_bench(fn):
    """``bench``, or None (with the reason printed) when a baseline or provider cannot run."""
    try:
        return bench(fn)
    except Exception as e:  # noqa: BLE001 - record why a baseline could not run
        print(f"  could not run: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rms_bwd_unfused(g, x, gamma, r):
    """Stock RMSNorm backward given g = d(normalized output) (what autograd of rms_norm computes)."""
    xf, gf = x.float(), g.float()
    gg = gf * gamma.float()
    dot = (gg * xf).sum(-1, keepdim=True)
    dx = r[:, None] * gg - (r[:, None] ** 3 / x.shape[1]) * xf * dot
    dgamma = (gf * xf * r[:, None]).sum(0)
    return dx, dgamma


def float8_linears(*weights):
    """torchao float8 (tensorwise) linears holding ``weights``: the FP8 baseline's own layers."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mods = nn.ModuleList()
    for w in weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
        lin.weight.data.copy_(w)
        mods.append(lin)
    convert_to_float8_training(mods, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return list(mods)


class Setup:
    """The inputs the programs of hidden size ``d`` share, made once (M tokens, LLaMA-3 shapes)."""

    def __init__(self, d: int, gen: torch.Generator):
        from coda_titan.kernels import get_backend

        self.be = get_backend("cute")
        self.d, self.gen = d, gen
        self.ff, self.hq, self.hkv, self.hd = SHAPES[d]
        self.q = (self.hq + 2 * self.hkv) * self.hd
        self.bs = M // SEQLEN
        self.rstd = torch.rand(M, generator=gen, device="cuda") + 0.5
        self.gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
        self.h = self.r(M, d)

    def r(self, *shape, scale=1.0, dtype=BF):
        return (torch.randn(*shape, generator=self.gen, device="cuda") * scale).to(dtype)

    @functools.cached_property
    def w1_w3(self):
        return self.r(self.ff, self.d, scale=self.d**-0.5), self.r(self.ff, self.d, scale=self.d**-0.5)

    @functools.cached_property
    def w13(self):
        from coda_titan.kernels._common import interleave_rows

        return interleave_rows(*self.w1_w3)

    @functools.cached_property
    def wqkv(self):
        return self.r(self.q, self.d, scale=self.d**-0.5)

    @functools.cached_property
    def w2(self):
        return self.r(self.d, self.ff, scale=self.ff**-0.5)

    @functools.cached_property
    def rope(self) -> dict:
        """The rope keywords of norm_rope / rope_bwd."""
        from torchtitan.models.llama3.model.args import RoPEScalingArgs

        from coda_titan.model.rope import rope_freqs

        freqs = rope_freqs(self.hd, 500000.0, RoPEScalingArgs()).cuda()
        return dict(freqs=freqs, seqlen=SEQLEN, n_rope_heads=self.hq + self.hkv, head_dim=self.hd)

    @functools.cached_property
    def freqs_cis(self):
        from torchtitan.models.llama3.model.args import RoPEScalingArgs
        from torchtitan.models.llama3.model.model import precompute_freqs_cis

        return precompute_freqs_cis(self.hd, SEQLEN, 500000.0, RoPEScalingArgs()).cuda()

    @functools.cached_property
    def w13q(self):
        """(e4m3 W13, its scale): the weight pass of W13."""
        return self.be.quantize_tensorwise(w=self.w13)

    @functools.cached_property
    def wqkv8(self):
        """(e4m3 W_qkv, its scale)."""
        return self.be.quantize_tensorwise(w=self.wqkv)

    @functools.cached_property
    def b1(self) -> dict:
        """The keywords of B1 (rope_bwd), with a small gradient."""
        return dict(dy=self.r(M, self.q, scale=1e-3), y=self.r(M, self.q), rstd=self.rstd, **self.rope)

    @functools.cached_property
    def b2(self):
        """(x, dresidual) of B2."""
        return self.r(M, self.d), self.r(M, self.d)

    @functools.cached_property
    def b3(self):
        """B3's keywords, its bf16 da and zdz, and the inverse e5m2 scale of that da's amax."""
        from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax

        kw = dict(dout=self.r(M, self.d, scale=1e-2), w_down=self.w2, a=self.r(M, 2 * self.ff), rstd=self.rstd)
        da, _, zdz = self.be.swiglu_bwd(**kw)
        return kw, da, zdz, inv_scale_from_amax(da.float().abs().amax(), E5M2_MAX)

    @functools.cached_property
    def h8(self):
        """(e4m3 H, its inverse scale): F2's and F3's fp8 A operand."""
        from coda_titan.kernels.scaling import inv_scale_from_amax, quantize_e4m3

        inv = inv_scale_from_amax(self.h.float().abs().amax())
        return quantize_e4m3(self.h.float(), inv), inv
