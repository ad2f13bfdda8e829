"""The CODA model on the torch backend computes exactly TorchTitan llama3's function (float64)."""

import math

import pytest
import torch
import torch.nn.functional as F

import torchtitan.models.llama3.model.model as stock_model
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from coda_titan.model.args import CodaModelArgs, coda_llama3_args
from coda_titan.titan.job_config import Coda
from coda_titan.model.model import CodaTransformer

# debugmodel with GQA; a dim (96) that is not a multiple of the tile (64); and Llama-3.1 RoPE
# scaling with all three frequency bands present (original context 32 < seqlen 48).
CASES = {
    "debugmodel_gqa": dict(tile_n=128, seqlen=64),
    "ragged_dim": dict(
        args=dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=97, multiple_of=32, rope_theta=10000),
        tile_n=64, seqlen=24,
    ),
    "rope_scaling": dict(
        args=dict(
            dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=89, multiple_of=64, rope_theta=10000,
            rope_scaling_args=RoPEScalingArgs(
                scaling_factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
            ),
        ),
        tile_n=32, seqlen=48,
    ),
}


def _args(case):
    spec = CASES[case]
    if "args" in spec:
        kw = dict(spec["args"])
    else:
        base = coda_llama3_args[case]
        kw = {k: getattr(base, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "rope_theta")}
    kw["max_seq_len"] = spec["seqlen"]
    return kw, spec


def _fp64_apply_rotary_emb(xq, xk, freqs_cis, positions=None):
    """TorchTitan's apply_rotary_emb with the fp32 casts removed (the same rotation in fp64)."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    fc = stock_model.reshape_for_broadcast(freqs_cis, xq_, positions)
    return torch.view_as_real(xq_ * fc).flatten(3), torch.view_as_real(xk_ * fc).flatten(3)


def _fp64_freqs_cis(dim, end, theta, s):
    """TorchTitan's precompute_freqs_cis, written out again in fp64."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    wavelen = 2 * math.pi / freqs
    hi = s.original_max_position_embeddings / s.high_freq_factor
    lo = s.original_max_position_embeddings / s.low_freq_factor
    freqs = torch.where(wavelen > lo, freqs / s.scaling_factor, freqs)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * freqs / s.scaling_factor + smooth * freqs
    freqs = torch.where(~(wavelen < hi) * ~(wavelen > lo), smoothed, freqs)
    angles = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles), wavelen, lo, hi


def _build(case, fp64_rope):
    kw, spec = _args(case)
    torch.manual_seed(0)
    ref = Transformer(TransformerModelArgs(**kw))
    with torch.no_grad():
        ref.init_weights()
        for name, p in ref.named_parameters():  # non-trivial norm weights so dgamma is exercised
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ref = ref.double()
    if fp64_rope:
        a = ref.model_args
        ref.freqs_cis = _fp64_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, a.rope_scaling_args)[0]
    coda = CodaTransformer(CodaModelArgs(**kw, coda=Coda(backend="torch", tile_n=spec["tile_n"], ce_chunk_rows=37))).double()
    coda.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, kw["vocab_size"], (2, spec["seqlen"]), generator=g)
    labels = torch.randint(0, kw["vocab_size"], (2, spec["seqlen"]), generator=g)
    labels[0, :5] = -100  # TorchTitan's ignore index
    return ref, coda, tokens, labels


def _compare(case, fp64_rope, monkeypatch):
    if fp64_rope:
        monkeypatch.setattr(stock_model, "apply_rotary_emb", _fp64_apply_rotary_emb)
    ref, coda, tokens, labels = _build(case, fp64_rope)
    logits = ref(tokens)
    assert logits.dtype == torch.float64
    loss_ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    loss_ref.backward()
    loss = coda(tokens, labels=labels)
    loss.backward()
    errs = {"loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())}
    ref_params = dict(ref.named_parameters())
    for name, p in coda.named_parameters():
        g_ref = ref_params[name].grad
        assert p.grad is not None, f"no gradient for {name}"
        errs[name] = ((p.grad - g_ref).norm() / g_ref.norm()).item()
    assert len(errs) == len(ref_params) + 1
    return errs


@pytest.mark.parametrize("case", list(CASES))
def test_matches_stock_llama3_fp64_rope(case, monkeypatch):
    errs = _compare(case, fp64_rope=True, monkeypatch=monkeypatch)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-10, f"{worst}: relative error {errs[worst]:.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_stock_llama3_as_shipped(case, monkeypatch):
    # Stock TorchTitan rotates in fp32 (complex64 freqs), even for fp64 inputs: bound 1e-6.
    errs = _compare(case, fp64_rope=False, monkeypatch=monkeypatch)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, f"{worst}: relative error {errs[worst]:.3e}"


def test_rope_scaling_case_exercises_all_bands():
    kw, _ = _args("rope_scaling")
    a = TransformerModelArgs(**kw)
    _, wavelen, lo, hi = _fp64_freqs_cis(a.dim // a.n_heads, 8, a.rope_theta, a.rope_scaling_args)
    assert (wavelen < hi).any() and (wavelen > lo).any() and ((wavelen >= hi) & (wavelen <= lo)).any()


def test_state_dict_round_trip_both_ways():
    kw, _ = _args("ragged_dim")
    ref = Transformer(TransformerModelArgs(**kw))
    coda = CodaTransformer(CodaModelArgs(**kw, coda=Coda(backend="torch")))
    assert list(ref.state_dict()) == list(coda.state_dict())
    assert all(ref.state_dict()[k].shape == v.shape for k, v in coda.state_dict().items())
    coda.load_state_dict(ref.state_dict())
    ref.load_state_dict(coda.state_dict())


def test_logits_path_matches_stock():
    ref, coda, tokens, _ = _build("ragged_dim", fp64_rope=False)
    with torch.no_grad():
        a, b = ref(tokens), coda(tokens)
    assert ((a - b).norm() / a.norm()).item() <= 1e-6
