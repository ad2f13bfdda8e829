"""The records that carry a layer's fp8 operands, scales and sites into the programs' Functions
(``autograd``) and the blocks (``model``): one frozen record per consumer, None where a precision or a
knob does not use it (precision = "fp8"; docs/fp8.md has the recipe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizeH:
    """F1 also writes its H as e4m3 for the next consumer, with ``inv_scale`` (the site's delayed
    scale; None = the current amax, the calibration step), and reports amax |H|; with ``transposed``
    (an F1 on an fp8 mainloop only; ``fp8_mlp_h_t``, ``fp8_qkv_wgrad``) also Hq^T, (d, M) token-major."""

    inv_scale: torch.Tensor | None
    transposed: bool = False


@dataclass(frozen=True)
class Fp8Operands:
    """The e4m3 operands of a consumer GEMM: ``hq`` (H quantized with ``inv_a``) and the layer's
    e4m3 weight ``w`` with its scale ``s_w`` (the weight pass). ``w_t`` is that weight transposed,
    for an fp8 dgrad (B2 on an e5m2 gradient); None: the dgrad stays bf16. F3's: ``grad_inv`` is that
    gradient's delayed e5m2 scale (None = calibrate on the current amax)."""

    hq: torch.Tensor
    inv_a: torch.Tensor
    w: torch.Tensor
    s_w: torch.Tensor
    w_t: torch.Tensor | None = None
    grad_inv: torch.Tensor | None = None
    hq_t: torch.Tensor | None = None  # F3's: ``hq`` transposed, (d, M), as its producer wrote it (``fp8_qkv_wgrad``)


@dataclass(frozen=True)
class Fp8Input:
    """An F1 on an fp8 mainloop (``fp8_down_proj``: W2; ``fp8_out_proj``: W_o): its input is cast to
    e4m3 with the site's delayed scale ``inv`` (None = the current amax, the calibration step) and F1
    multiplies it by the layer's e4m3 weight ``w`` (scale ``s_w``). The backward keeps the bf16
    weight (straight through), except with ``w_t`` (that weight's e4m3 transpose, ``fp8_out_bwd``)."""

    w: torch.Tensor
    s_w: torch.Tensor
    inv: torch.Tensor | None
    w_t: torch.Tensor | None = None
    grad_amax: bool = False  # (``fp8_out_bwd``) the consumer of X reports amax |dX| (``edges.amax_token``)


@dataclass(frozen=True)
class MlpFp8:
    """The MLP sub-layer on fp8: F2 on ``f2``'s operands; F1 writes e4m3 H for the next layer when
    ``quantize_next`` is given (every layer but the last). With a gradient sink given to the
    Function (``fp8_mlp_dgrad`` or ``fp8_mlp_wgrad``), B3 also writes da as e5m2 with the delayed
    ``grad_inv_scale`` (None = calibrate on the current amax); B2 then runs on it when ``f2.w_t`` is
    given, and dW13 is torchao's fp8 weight gradient when ``h_amax`` (amax |H| from F1) is given.
    With ``down``, F1 runs its GEMM on e4m3 y and W2, and the Function's outputs end with amax |y|.
    With ``w2_t`` (the layer's e4m3 W2 transposed, scale ``s_w2``; ``fp8_down_dgrad``) and the e5m2
    B3, B3's GEMM runs on fp8 too: D cast to e5m2 with its current power-of-two scale times W2q^T."""

    f2: Fp8Operands
    quantize_next: QuantizeH | None
    grad_inv_scale: torch.Tensor | None = None
    h_amax: torch.Tensor | None = None
    down: Fp8Input | None = None
    w2_t: torch.Tensor | None = None
    s_w2: torch.Tensor | None = None
    hq_t: torch.Tensor | None = None  # F1's Hq^T (``fp8_mlp_h_t``): dW13 reads it, and H is not saved
    grad_amax: bool = False  # the next layer's F3 Function reports amax |dX_out| (``edges.amax_token``, last output)
    preact: bool = False  # ``fp8_preact``: F2 saves a as e4m3 codes, and the outputs end with amax |a| (before any token)
    inv_pre: torch.Tensor | None = None  # that site's delayed power-of-two scale (None: calibrate, a saved in bf16)


@dataclass(frozen=True)
class LayerFp8:
    """One layer's fp8 inputs: its attention input's e4m3 H (``attn.hq``, scale ``attn.inv_a``) and W_qkv;
    the delayed scales of its MLP input (``inv_ffn``) and the next layer's (``inv_next``; None = calibrate
    on the current amax), ``last``; its e4m3 W13 (scale ``s_13``, transposed ``w13_t`` or None); the MLP's
    delayed gradient scale and amax sink (None without an e5m2 gradient); whether dW13 runs on fp8; the
    F1 input sites' e4m3 weights and delayed input scales (``fp8_down_proj``, ``fp8_out_proj``)."""

    attn: Fp8Operands
    inv_ffn: torch.Tensor | None
    inv_next: torch.Tensor | None
    last: bool
    w13: torch.Tensor
    s_13: torch.Tensor
    w13_t: torch.Tensor | None
    grad_inv_scale: torch.Tensor | None
    grad_sink: torch.Tensor | None
    mlp_wgrad: bool
    down: Fp8Input | None = None
    out: Fp8Input | None = None
    w2_t: torch.Tensor | None = None  # e4m3 W2^T and its scale, for B3 on fp8 (fp8_down_dgrad)
    s_w2: torch.Tensor | None = None
    mlp_h_t: bool = False  # the out-projection's F1 also writes Hq^T, dW13's input (fp8_mlp_h_t)
    qkv_grad_sink: torch.Tensor | None = None  # F3's gradient site's amax sink (fp8_dgrad; its scale: attn.grad_inv)
    qkv_h_t: bool = False  # the down-projection's F1 also writes Hq^T, the next layer's dW_qkv input (fp8_qkv_wgrad)
    mlp_amax: bool = False  # the MLP casts dX_out at the amax the next layer's F3 returns to its token
    amax_tok: torch.Tensor | None = None  # the layer below's MLP amax token: F3's backward returns amax |dX| to it
    preact: bool = False  # ``fp8_preact``: F2 saves a as e4m3 codes (``MlpFp8.preact``)
    inv_pre: torch.Tensor | None = None
