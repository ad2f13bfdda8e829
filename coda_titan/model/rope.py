"""RoPE frequencies with TorchTitan's formula (``precompute_freqs_cis``, Llama-3.1 scaling), in fp64.

TorchTitan computes the angles in fp32; the programs form pos * freqs[j] from these fp64 values
(the torch reference in fp64, the fused kernel as a float-float angle), so cos/sin are exact to the
compute dtype (the fp64 tests compare at 1e-10).
"""

from __future__ import annotations

import math

import torch

from torchtitan.models.llama3.model.args import RoPEScalingArgs


def rope_freqs(head_dim: int, theta: float, scaling: RoPEScalingArgs) -> torch.Tensor:
    """Per-pair angular frequency (head_dim/2,), fp64, the formula of TorchTitan 0.2.2."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64)[: head_dim // 2] / head_dim))
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    freqs = torch.where(wavelen > low_freq_wavelen, freqs / scaling.scaling_factor, freqs)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * freqs / scaling.scaling_factor + smooth * freqs
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, freqs)
