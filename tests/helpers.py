"""Shared inputs and checks of the program tests (tests/test_<program>.py)."""

import math
import os
import zlib

import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels._common import interleave_rows
from coda_titan.kernels.scaling import E4M3_MAX, inv_scale_from_amax, quantize_e4m3
from coda_titan.model.autograd import ProgramConfig
from coda_titan.model.rope import rope_freqs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")  # GPU correctness does not need the tile sweep

TORCH = get_backend("torch")
BF = torch.bfloat16

# CPU gradchecks: odd shapes on purpose: d = 24 with tile 16 (ragged last tile), GQA (4 q heads,
# 2 kv heads), rows = 2 sequences of 5
BS, SEQ, D, FF, V = 2, 5, 24, 10, 13
HQ, HKV, HD = 4, 2, 6
EPS = 1e-5
CFG = ProgramConfig(backend=TORCH, tile_n=16, eps=EPS, ce_chunk_rows=3)
M = BS * SEQ

# opcheck shapes
OP_M, OP_D, OP_F, OP_V, OP_HQ, OP_HKV, OP_HD, OP_SEQ = 12, 32, 24, 40, 4, 2, 8, 6

# GPU: d in {2048, 4096, 8192}, M = 2000 (not a multiple of 128)
DIMS = [2048, 4096, 8192]
GPU_SEQ, GPU_BS = 1000, 2


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rand64(*shape, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()


def deferred_norm(x, gamma):
    """What the producer epilogue and finalize hand the consumer: H, r (no autograd)."""
    with torch.no_grad():
        h, s = CFG.backend.rms_partial(x=x, gamma=gamma, tile_n=CFG.tile_n)
        r = CFG.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=EPS)
    return h, r


def op_cases(dtype):
    """Positional arguments of every bf16 program's op, small shapes, for ``opcheck``."""
    g = torch.Generator().manual_seed(0)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt)

    q = (OP_HQ + 2 * OP_HKV) * OP_HD
    rstd = torch.rand(OP_M, generator=g) + 0.5
    freqs = rope_freqs(OP_HD, 10000.0, RoPEScalingArgs())
    targets = torch.randint(0, OP_V, (OP_M,), generator=g)
    targets[3] = -100
    rope = (freqs, OP_SEQ, OP_HQ + OP_HKV, OP_HD)
    return {
        "rms_partial": (r(OP_M, OP_D), r(OP_D), 16),
        "residual_rms": (r(OP_M, 16), r(OP_D, 16), r(OP_M, OP_D), r(OP_D), 16),
        "rstd_finalize": (torch.rand(OP_M, 3, generator=g), OP_D, 1e-5),
        "norm_swiglu": (r(OP_M, OP_D), rstd, interleave_rows(r(OP_F, OP_D), r(OP_F, OP_D))),
        "norm_rope": (r(OP_M, OP_D), rstd, r(q, OP_D), *rope),
        "lm_head_ce": (r(OP_M, OP_D), rstd, r(OP_M, OP_D), r(OP_D), r(OP_V, OP_D), targets, 5, True),
        "rope_bwd": (r(OP_M, q), r(OP_M, q), rstd, *rope),
        "norm_residual_bwd": (r(OP_M, q), r(q, OP_D), r(OP_M, OP_D), r(OP_D), rstd, r(OP_M, dt=torch.float32), r(OP_M, OP_D)),
        "swiglu_bwd": (r(OP_M, OP_D), r(OP_D, OP_F), r(OP_M, 2 * OP_F), rstd),
        "wgrad": (r(OP_M, OP_F), r(OP_M, OP_D), dtype),
        "dgrad": (r(OP_M, OP_F), r(OP_F, OP_D), dtype),
    }


def e4m3_round_fp64(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3fn grid, saturating at 448, in fp64 (from the format:
    3 mantissa bits, exponent bias 7, min normal 2^-6, subnormal step 2^-9)."""
    out = torch.empty_like(v)
    for i, x in enumerate(v.tolist()):
        a = min(abs(x), E4M3_MAX)
        e = max(math.floor(math.log2(a)), -6) if a > 0 else -6
        step = 2.0 ** (e - 3)
        q = a / step
        lo = math.floor(q)
        frac = q - lo
        n = lo + (1 if frac > 0.5 or (frac == 0.5 and lo % 2 == 1) else 0)
        out[i] = math.copysign(min(n * step, E4M3_MAX), x)
    return out


def fp8_operands(m, k, n, gen, dtype=torch.float32):
    h = torch.randn(m, k, generator=gen, dtype=dtype) * 3
    w = torch.randn(n, k, generator=gen, dtype=dtype) * k**-0.5
    inv_h = inv_scale_from_amax(h.abs().amax().float())
    hq = quantize_e4m3(h.float(), inv_h)
    wq, s_w = TORCH.quantize_tensorwise(w=w.float())
    rstd = torch.rand(m, generator=gen, dtype=torch.float32) + 0.5
    return hq, wq, (s_w / inv_h).float(), rstd


def poison():
    """Fill the caching allocator's free memory with NaN so that unwritten outputs are visible."""
    free, _ = torch.cuda.mem_get_info()
    blocks = []
    for size in (1 << 30, 1 << 28, 1 << 26, 1 << 22):
        try:
            while len(blocks) < 64 and torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 8 << 30:
                blocks.append(torch.full((size // 4,), float("nan"), device="cuda"))
        except torch.OutOfMemoryError:
            pass
    del blocks


def shapes(d):
    hd = 64 if d == 2048 else 128
    hq = d // hd
    return dict(hd=hd, hq=hq, hkv=hq // 4, ff=2 * d)


def gpu_inputs(name, d, gen):
    """Random bf16 inputs of program ``name`` at hidden size d (GQA 4:1, M not a multiple of 128)."""
    from coda_titan.kernels._common import interleave_rows
    from coda_titan.model.rope import rope_freqs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    s = shapes(d)
    m = GPU_SEQ * GPU_BS
    q = (s["hq"] + 2 * s["hkv"]) * s["hd"]

    def r(*shape, scale=1.0, dtype=BF):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    rope = dict(freqs=rope_freqs(s["hd"], 500000.0, RoPEScalingArgs()).cuda(), seqlen=GPU_SEQ,
                n_rope_heads=s["hq"] + s["hkv"], head_dim=s["hd"])
    if name == "residual_rms":
        return dict(y=r(m, d), weight=r(d, d, scale=d**-0.5), residual=r(m, d), gamma=r(d), tile_n=128)
    if name == "norm_swiglu":
        w13 = interleave_rows(r(s["ff"], d, scale=d**-0.5), r(s["ff"], d, scale=d**-0.5))
        return dict(h=r(m, d), rstd=rstd, w13=w13)
    if name == "swiglu_bwd":
        return dict(dout=r(m, d), w_down=r(d, s["ff"], scale=s["ff"] ** -0.5), a=r(m, 2 * s["ff"]), rstd=rstd)
    if name == "norm_rope":
        return dict(h=r(m, d), rstd=rstd, weight=r(q, d, scale=d**-0.5), **rope)
    if name == "rope_bwd":
        return dict(dy=r(m, q), y=r(m, q), rstd=rstd, **rope)
    if name == "norm_residual_bwd":
        return dict(da=r(m, q), weight=r(q, d, scale=q**-0.5), x=r(m, d), gamma=r(d), rstd=rstd,
                    zdz=r(m, dtype=torch.float32), dresidual=r(m, d))
    if name == "lm_head_ce":
        vocab = 16384
        targets = torch.randint(0, vocab, (m,), generator=gen, device="cuda")
        targets[::7] = -100
        return dict(h=r(m, d), rstd=rstd, x=r(m, d), gamma=r(d), weight=r(vocab, d, scale=d**-0.5),
                    targets=targets, chunk_rows=768, compute_grad=True)
    if name == "rstd_finalize":
        return dict(partials=torch.rand(m, 3, generator=gen, device="cuda") * d, dim=d, eps=1e-5)
    raise KeyError(name)


def as_list(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if t is not None]


def to64(kw):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}


def check_cute_matches_reference(name: str, d: int, **overrides) -> None:
    """The cute kernel of program ``name`` against the reference evaluated in fp64 on the same bf16
    inputs. Free allocator blocks are NaN-filled first, so an unwritten output shows as NaN.

    The bound, per output: ``2 * err_ref + 2**-24``, where ``err_ref`` is the norm-wise error against
    fp64 of the torch reference run on the same bf16 inputs in the kernel's own precisions (bf16
    operands, fp32 accumulator through the whole epilogue, one rounding to the output dtype; see
    ``kernels/_common.mm``). The kernel evaluates the same expression in the same precisions and
    differs only in summation order (tensor-core K blocks, per-tile partial sums), so its error is
    made of as many roundings of the same unit roundoff as the reference's: over >= 10^6 elements the
    norm-wise statistic concentrates, and a factor 2 covers a worse order. ``2**-24`` (one fp32
    rounding) keeps the bound meaningful where the reference happens to be exact. Each check is
    appended to ``$CODA_BOUNDS_LOG`` (jsonl) when set, so the GPU run reports measured against bound.
    ``overrides`` replace inputs of ``gpu_inputs`` (e.g. another ``chunk_rows``).
    """
    from coda_titan.kernels import get_backend

    ref_be, cute_be = get_backend("torch"), get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}:{d}".encode()))  # (hash() is salted per process)
    kw = {**gpu_inputs(name, d, gen), **overrides}
    ref64 = as_list(getattr(ref_be, name)(**to64(kw)))
    bf = as_list(getattr(ref_be, name)(**kw))
    poison()
    out = as_list(getattr(cute_be, name)(**kw))
    torch.cuda.synchronize()
    if name in ("residual_rms",):  # S: the kernel folds its tile partials; compare the row sums
        ref64[-1], bf[-1] = ref64[-1].sum(-1, keepdim=True), bf[-1].sum(-1, keepdim=True)
    assert len(out) == len(ref64)
    for i, (o, r64, b) in enumerate(zip(out, ref64, bf)):
        assert o.shape == r64.shape, (name, i, o.shape, r64.shape)
        assert o.dtype == b.dtype, (name, i, o.dtype, b.dtype)
        assert not o.isnan().any(), f"{name} output {i}: NaN (unwritten or invalid)"
        err, err_ref = rel(o, r64), rel(b, r64)
        bound = 2 * err_ref + 2.0**-24
        log_bound(f"{name}[{i}] d={d}" + "".join(f" {k}={v}" for k, v in overrides.items()), dtype=str(o.dtype), err=err, err_ref=err_ref, bound=bound)
        assert err <= bound, f"{name} d={d} output {i} ({o.dtype}): rel err {err:.3e} > 2 x reference {err_ref:.3e} + 2^-24"


def log_bound(check: str, **measured) -> None:
    """Append one measured-against-bound record to ``$CODA_BOUNDS_LOG`` (the GPU run's evidence)."""
    path = os.environ.get("CODA_BOUNDS_LOG")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"check": check, **measured}) + "\n")


def fp8_mma_error(aq: torch.Tensor, bq_t: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound, exact): an elementwise bound on how far an SM90 fp8 GEMM, scale * (aq @ bq_t^T), may be
    from its exact value, and that exact value (fp64). The fp8 MMA keeps its running sum in the tensor
    core with about 14 bits and is never promoted (DeepSeek-V3, sec. 3.3.2), so an element's error
    scales with the sum of its |products| P, not with the element: one that cancels is off by many of
    its own rounding steps. The same accumulator's error on the same operands, measured as
    c = max |cuBLAS fast-accumulation - exact| / P (another order), bounds it: 2 c P + 2^-24 |exact|
    (the fp32 result's own rounding)."""
    s = scale.double()
    c, exact, p = fp8_mma_c(aq, bq_t)
    return 2 * c * p * s + 2.0**-24 * exact.abs() * s, exact * s


def fp8_mma_c(aq: torch.Tensor, bq_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, exact, P) of ``fp8_mma_error``, unscaled: c = max |cuBLAS fast-accumulation aq @ bq_t^T - exact| / P,
    exact and P = |aq| @ |bq_t|^T in fp64."""
    one = torch.ones((), device=aq.device)
    exact = aq.double() @ bq_t.double().t()
    p = aq.double().abs() @ bq_t.double().abs().t()
    fast = torch._scaled_mm(aq, bq_t.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
    return ((fast.double() - exact).abs() / p.clamp_min(torch.finfo(torch.float64).tiny)).amax(), exact, p


def assert_codes_within(check: str, got: torch.Tensor, want: torch.Tensor, step: torch.Tensor, err: torch.Tensor) -> None:
    """A kernel's fp8 codes against the exact values' codes, both dequantized onto the scaled grid:
    two round-to-nearest casts of values at most ``err`` apart land at most that far plus one rounding
    step (``step``, of the larger code) apart. Logs the worst margin; a failure names the worst code."""
    excess = (got - want).abs() - (step + err)
    log_bound(f"{check} (|codes - exact codes| - bound, worst)", err=excess.max().item(), bound=0.0,
              codes_differing=(got != want).double().mean().item())
    w = excess.flatten().argmax()
    assert (excess <= 0).all(), (f"{check}: {(excess > 0).sum().item()} codes beyond the bound, worst by {excess.max():.3g} "
                                 f"(kernel {got.flatten()[w]:.4g}, exact {want.flatten()[w]:.4g}, "
                                 f"error bound {err.flatten()[w]:.3g})")


def cuda_inputs(m, k, n, gen):
    h = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(BF)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(BF)
    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    return h, w, rstd


def f2_fp8_cuda(seed: int, m: int = 4096, d: int = 2048, ff: int = 8192):
    """F2's fp8 operands on the GPU (the 1B MLP's shapes by default), H cast at its current amax and W13 by the cute
    weight pass: (cute backend, h, rstd, hq, w1, w13q, scale = s_w / inv_h)."""
    import coda_titan.kernels.cute  # noqa: F401
    from coda_titan.kernels import get_backend
    from coda_titan.kernels._common import interleave_rows
    from coda_titan.kernels.scaling import inv_scale_from_amax, quantize_e4m3

    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")
    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, _, rstd = cuda_inputs(m, d, 8, gen)
    inv = inv_scale_from_amax(h.float().abs().amax())
    w1, w3 = ((torch.randn(ff, d, generator=gen, device="cuda") * d**-0.5).to(BF) for _ in range(2))
    w13q, s_w = cute.quantize_tensorwise(w=interleave_rows(w1, w3))
    return cute, h, rstd, quantize_e4m3(h.float(), inv), w1, w13q, s_w / inv


def torchao_linear_error(n_input, w, exact):
    """||torchao float8 tensorwise linear(n_input) - exact|| / ||exact||: the FP8 baseline's error."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=BF))
    lin[0].weight.data.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    with torch.no_grad():
        return rel(lin(n_input), exact)


def compiled_1b_width_model(coda, seqlen: int, n_layers: int = 2, fa4: bool = False, ac: str = "none",
                            compile_: bool = True):
    """A CODA model of the 1B's width with ``n_layers`` layers on the GPU, in bf16, initialized from seed 0
    and parallelized as the Trainer does on one GPU with compiled blocks (inductor; ``compile_`` False:
    eager) and activation checkpointing ``ac``: what the GPU tests of whole training steps run. ``fa4``:
    FA4 attention (the configs' ``fa4`` converter) instead of SDPA."""
    import dataclasses
    from types import SimpleNamespace

    from torchtitan.config.job_config import ActivationCheckpoint, Compile

    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.parallelize import parallelize_coda

    args = dataclasses.replace(coda_llama3_args["1B"], n_layers=n_layers, max_seq_len=seqlen, coda=coda)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CodaTransformer(args)
        with torch.no_grad():
            model.init_weights()
    model = model.to(torch.bfloat16)
    if fa4:
        from coda_titan.titan.fa4 import swap_attention

        swap_attention(model)
    job = SimpleNamespace(coda=coda, compile=Compile(enable=compile_, components=["model"], backend="inductor"),
                          activation_checkpoint=ActivationCheckpoint(mode=ac), job=SimpleNamespace(dump_folder="."))
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, fsdp_enabled=False,
                           dp_replicate_enabled=False)
    parallelize_coda(model, dims, job)
    return model


def run_interpreter_check(script: str) -> dict:
    """Run ``tests/<script>`` (a ``*_interpreter_check.py``) in a subprocess with TRITON_INTERPRET=1 (read when
    triton is imported, hence a process of its own) and return the JSON line of measurements it prints."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script))],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class FakeStream:
    def __init__(self, cuda, name):
        self.rec, self.name = cuda, name

    def wait_stream(self, other):
        self.rec.log.append(("wait_stream", self.name, other.name))


class FakeCuda:
    """A stand-in of ``torch.cuda``'s stream API for the stream knobs' CPU tests: streams that log what they
    are asked in ``log``; ``current`` names the current stream, ``new`` the one ``Stream()`` makes."""

    stream_class = FakeStream  # (a test's subclass may add methods)

    def __init__(self, current: str, new: str):
        self.log, self.current, self.new = [], current, new

    def current_stream(self, device=None):
        return self.stream_class(self, self.current)

    def set_stream(self, stream):
        self.log.append(("set_stream", stream.name))
        self.current = stream.name

    def Stream(self, device):  # noqa: N802 (torch.cuda.Stream)
        return self.stream_class(self, self.new)


def optimizer_check_refuses(check, knob: str, change: dict, needs: str) -> None:
    """A one-device optimizer knob's config ``check`` (``fused_clip``, ``coda_adamw``): with ``knob`` on and the
    TorchTitan optimizer settings (name AdamW, fused, no early step; one device) changed by ``change``
    (``world_size`` among them), it raises a ConfigError naming ``needs``; with the knob off it checks nothing."""
    import pytest

    from coda_titan.titan.job_config import ConfigError

    change = dict(change)
    world = change.pop("world_size", 1)
    opt = {"name": "AdamW", "implementation": "fused", "early_step_in_backward": False, **change}
    job = type("Job", (), {"coda": type("C", (), {knob: True})(), "optimizer": type("Opt", (), opt)()})()
    dims = type("Dims", (), {"world_size": world})()
    with pytest.raises(ConfigError, match=needs):
        check(job, dims)
    setattr(job.coda, knob, False)
    check(job, dims)  # (off: nothing to check)
