"""The CODA LLaMA-3 model: TorchTitan's llama3 parameters, CODA's program graph.

Parameters, their names, shapes and initialization are inherited from TorchTitan's ``Transformer``,
so checkpoints and state dicts move between ``llama3`` and ``coda_llama3`` both ways. Only the
forward differs: it runs the GEMM-plus-epilogue programs of CODA.md.

Program chain (one row of tokens; r = deferred rstd, H = X * gamma, S = partial sums of X^2):

    prologue:  X0 = embed(tokens); H, S = rms_partial(X0, gamma_attn[0]); r = finalize(S)
    layer l:   qkv = F3(H, r)                       # QKV GEMM + rstd + RoPE
               o   = attention(qkv)                  # untouched (SDPA)
               X, H, S = F1(o, Wo, X, gamma_ffn[l]); r = finalize(S)
               X, H, S = F2 -> F1(W2, gamma_next);   r = finalize(S)
    head:      loss = F4(H, r)                       # chunked LM head + CE (+ its gradient)

The paper draws a fused block from layer l's out-projection to layer l+1's QKV; this is the same
chain of programs cut at attention instead, so that each ``layers.{l}`` module runs on exactly the
weights it owns (its FSDP/compile/AC unit) plus the next norm's gamma (d floats), which F1's
epilogue needs to write H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan.models.llama3.model.model import Transformer, TransformerBlock

from ..kernels import get_backend, resolve_backend
from .args import CodaModelArgs
from ..kernels.fp8 import E5M2_MAX, inv_scale_from_amax
from .programs import (
    LMHeadCE,
    NormRoPE,
    NormRoPEFp8,
    NormSwiGLUResidual,
    NormSwiGLUResidualFp8,
    ProgramConfig,
    ResidualRMS,
    ResidualRMSFp8,
)

PRECISIONS = ("bf16", "fp8")
from .rope import rope_freqs


class CodaTransformerBlock(TransformerBlock):
    """One layer as programs: F3 -> attention -> F1(Wo) -> F2 -> F1(W2). Same parameters as stock."""

    def forward(self, x, h, rstd, freqs, seqlen: int, gamma_next, cfg: ProgramConfig, fp8=None):
        """One layer. ``fp8`` (precision = "fp8") is (hq, inv_attn, inv_ffn, inv_next, last, wqkv_q,
        s_qkv, wqkv_qt, w13_q, s_13, w13_qt, inv_grad, grad_sink, mlp_wgrad): e4m3 H of this layer's
        input, the delayed inverse scales of its two consumer sites and of the next layer's input (None
        = calibrate with the current amax), and the layer's e4m3 weights with their scales
        (``fp8_layer_weights``; the transposed copies wqkv_qt / w13_qt for the fp8 dgrads are None
        unless ``fp8_dgrad`` / ``fp8_mlp_dgrad``); when the MLP's gradient is e5m2 (``fp8_mlp_dgrad``
        or ``fp8_mlp_wgrad``), its delayed inverse scale and the tensor whose gradient receives its
        amax (else None, None), and whether dW13 runs on fp8 (torchao's recipe: current scales, from
        the amaxes of da and H that B3 and F1 report). Returns (x, h, rstd) for bf16 and
        (x, h, rstd, hq_next, amax_ffn, amax_next) for fp8 (hq_next / amax_next None on the last layer)."""
        # x, h: (M, dim) with M = bs * seqlen; rstd: (M,); freqs: (head_dim/2,) fp64
        attn = self.attention
        m = x.shape[0]
        bs = m // seqlen
        hd = attn.head_dim
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        qkv_weights = (self.attention_norm.weight, attn.wq.weight, attn.wk.weight, attn.wv.weight)
        if fp8 is None:
            qkv, x = NormRoPE.apply(h, rstd, x, *qkv_weights, freqs, seqlen, cfg, n_q + n_kv, hd)
        else:
            hq, inv_attn, inv_ffn, inv_next, last, wqkv_q, s_qkv, wqkv_qt, w13_q, s_13, w13_qt, inv_g, g_sink, wgrad8 = fp8
            qkv, x = NormRoPEFp8.apply(
                hq, h, rstd, x, *qkv_weights, freqs, seqlen, cfg, n_q + n_kv, hd, inv_attn, wqkv_q, s_qkv, wqkv_qt
            )
        q, k, v = qkv.split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
        q = q.view(bs, seqlen, n_q, hd).transpose(1, 2)  # (bs, n_heads, seqlen, head_dim)
        k = k.view(bs, seqlen, n_kv, hd).transpose(1, 2)  # (bs, n_kv_heads, seqlen, head_dim)
        v = v.view(bs, seqlen, n_kv, hd).transpose(1, 2)
        o = attn.inner_attention(q, k, v, enable_gqa=attn.enable_gqa)  # (bs, n_heads, seqlen, head_dim)
        o = o.transpose(1, 2).reshape(m, n_q * hd)
        ff = self.feed_forward
        mlp_weights = (self.ffn_norm.weight, ff.w1.weight, ff.w3.weight, ff.w2.weight, gamma_next)
        if fp8 is None:
            x, h, s = ResidualRMS.apply(o, attn.wo.weight, x, self.ffn_norm.weight, cfg)
            rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
            x, h, s = NormSwiGLUResidual.apply(h, rstd, x, *mlp_weights, cfg)
            rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
            return x, h, rstd
        x, h, s, hq, amax_ffn = ResidualRMSFp8.apply(o, attn.wo.weight, x, self.ffn_norm.weight, cfg, inv_ffn)
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        inv_ffn = inv_scale_from_amax(amax_ffn) if inv_ffn is None else inv_ffn  # calibration: current
        out = NormSwiGLUResidualFp8.apply(
            hq, h, rstd, x, *mlp_weights, cfg, inv_ffn, not last, inv_next, w13_q, s_13, w13_qt, inv_g, g_sink,
            amax_ffn if wgrad8 else None,
        )
        x, h, s = out[:3]
        hq_next, amax_next = (None, None) if last else out[3:]
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        return x, h, rstd, hq_next, amax_ffn, amax_next


class CodaTransformer(Transformer):
    """TorchTitan llama3 ``Transformer`` whose forward runs the CODA programs.

    ``forward(tokens, labels=...)`` returns the summed token cross-entropy (TorchTitan's loss
    convention, ignore index -100), computed by the chunked LM-head program: the full logits are
    never materialized. Without ``labels`` it returns logits (bs, seqlen, vocab), for evaluation.
    """

    def __init__(self, model_args: CodaModelArgs):
        super().__init__(model_args)
        if model_args.attn_type != "sdpa":
            raise ValueError(
                f"coda_llama3 supports attn_type='sdpa' only, got {model_args.attn_type!r}; "
                "choose a flavor without flex/varlen attention"
            )
        if model_args.tile_n <= 0:
            raise ValueError(f"[coda] tile_n must be positive, got {model_args.tile_n}")
        if model_args.ce_chunk_rows <= 0:
            raise ValueError(f"[coda] ce_chunk_rows must be positive, got {model_args.ce_chunk_rows}")
        self.backend_name = resolve_backend(model_args.backend)
        self.layers = torch.nn.ModuleDict(
            {str(i): CodaTransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self._freqs_cache: dict[torch.device, torch.Tensor] = {}
        if model_args.precision not in PRECISIONS:
            raise ValueError(f"[coda] precision must be one of {PRECISIONS}, got {model_args.precision!r}")
        if model_args.fp8_amax_history <= 0:
            raise ValueError(f"[coda] fp8_amax_history must be positive, got {model_args.fp8_amax_history}")
        for flag in ("fp8_dgrad", "fp8_mlp_dgrad", "fp8_mlp_wgrad"):
            if not isinstance(getattr(model_args, flag), bool):
                raise ValueError(f"[coda] {flag} must be true or false, got {getattr(model_args, flag)!r}")
        if not 0 <= model_args.fp8_grad_margin <= 24:
            raise ValueError(f"[coda] fp8_grad_margin must be in 0..24 (a power-of-two exponent), got {model_args.fp8_grad_margin}")
        # precision = "fp8": amax history of the 2 per layer activation sites (F3's and F2's input H),
        # newest first. Not persistent: checkpoints stay stock llama3's; a resumed run recalibrates.
        self.register_buffer(
            "fp8_amax_history", torch.zeros(2 * model_args.n_layers, model_args.fp8_amax_history), persistent=False
        )
        self.fp8_calibrated = False
        # fp8_mlp_dgrad: the amax history of each layer's MLP gradient da (e5m2, B3 -> B2), fed by the
        # gradient of ``_fp8_grad_sink`` (see NormSwiGLUResidualFp8); not persistent either
        self.register_buffer(
            "fp8_grad_amax_history", torch.zeros(model_args.n_layers, model_args.fp8_amax_history), persistent=False
        )
        self.fp8_grad_calibrated = False
        self._fp8_grad_sink: torch.Tensor | None = None

    def init_weights(self, buffer_device=None):
        super().init_weights(buffer_device=buffer_device)
        device = buffer_device or self.fp8_amax_history.device
        self.fp8_amax_history = torch.zeros_like(self.fp8_amax_history, device=device)
        self.fp8_calibrated = False
        self.fp8_grad_amax_history = torch.zeros_like(self.fp8_grad_amax_history, device=device)
        self.fp8_grad_calibrated = False
        self._fp8_grad_sink = None

    def program_config(self) -> ProgramConfig:
        a = self.model_args
        return ProgramConfig(
            backend=get_backend(self.backend_name), tile_n=a.tile_n, eps=a.norm_eps, ce_chunk_rows=a.ce_chunk_rows
        )

    def _freqs(self, device: torch.device) -> torch.Tensor:
        """TorchTitan's per-pair RoPE frequencies (Llama-3.1 scaling applied), fp64, on ``device``."""
        if device not in self._freqs_cache:
            a = self.model_args
            self._freqs_cache[device] = rope_freqs(a.dim // a.n_heads, a.rope_theta, a.rope_scaling_args).to(device)
        return self._freqs_cache[device]

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions=None, labels=None):
        if attention_masks is not None or positions is not None:
            raise NotImplementedError("coda_llama3 runs causal SDPA on contiguous positions only")
        cfg = self.program_config()
        bs, seqlen = tokens.shape
        x = self.tok_embeddings(tokens).view(bs * seqlen, -1)  # (M, dim)
        freqs = self._freqs(x.device)
        layers = list(self.layers.values())
        with torch.no_grad():  # prologue: H and S are non-differentiable by construction
            gamma0 = layers[0].attention_norm.weight if layers else self.norm.weight
            fp8 = self.model_args.precision == "fp8" and bool(layers)
            if fp8:
                inv = self._fp8_inv_scales()
                h, s, hq, amax0 = cfg.backend.rms_partial_fp8(x=x, gamma=gamma0, tile_n=cfg.tile_n, inv_scale=inv[0])
            else:
                h, s = cfg.backend.rms_partial(x=x, gamma=gamma0, tile_n=cfg.tile_n)
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        if fp8:
            x, h, rstd = self._fp8_layers(x, h, hq, amax0, inv, rstd, freqs, seqlen, cfg, layers)
        else:
            for i, layer in enumerate(layers):
                gamma_next = layers[i + 1].attention_norm.weight if i + 1 < len(layers) else self.norm.weight
                x, h, rstd = layer(x, h, rstd, freqs, seqlen, gamma_next, cfg)
        if labels is None:
            logits = (h @ self.output.weight.t()).to(rstd.dtype) * rstd[:, None]
            return logits.to(h.dtype).view(bs, seqlen, -1)
        compute_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, self.norm.weight, self.output.weight)
        )
        return LMHeadCE.apply(
            h, rstd, x, self.norm.weight, self.output.weight, labels.reshape(-1), cfg, compute_grad
        )

    # --- precision = "fp8" -----------------------------------------------------------------------

    def _fp8_inv_scales(self) -> list:
        """Per-site inverse scales 448 / max(amax history), or all None on the calibration step."""
        if not self.fp8_calibrated:
            return [None] * self.fp8_amax_history.shape[0]
        return list(inv_scale_from_amax(self.fp8_amax_history.amax(-1)).unbind(0))

    def _fp8_layers(self, x, h, hq, amax0, inv, rstd, freqs, seqlen, cfg, layers):
        """The layer chain with e4m3 F2/F3 operands. Site 2i is layer i's attention input, 2i + 1 its
        MLP input; a training forward records each site's current amax in the history."""
        amaxes = [amax0]
        a = self.model_args
        mlp_dgrad = a.fp8_mlp_dgrad and torch.is_grad_enabled()  # (the transposed weights serve the backward only)
        mlp_wgrad = a.fp8_mlp_wgrad and torch.is_grad_enabled()
        qkv_dgrad = a.fp8_dgrad and torch.is_grad_enabled()
        with torch.no_grad():  # the weight pass (straight-through: the backward uses the bf16 weights)
            w13_q, s_13, wqkv_q, s_qkv, w13_qt, wqkv_qt = cfg.backend.fp8_layer_weights(
                w1=[l.feed_forward.w1.weight for l in layers], w3=[l.feed_forward.w3.weight for l in layers],
                wq=[l.attention.wq.weight for l in layers], wk=[l.attention.wk.weight for l in layers],
                wv=[l.attention.wv.weight for l in layers], w13_t=mlp_dgrad, wqkv_t=qkv_dgrad,
            )
            inv_g, sink = self._fp8_grad_sites(x.device, mlp_dgrad or mlp_wgrad)  # B3 writes e5m2 da
        for i, layer in enumerate(layers):
            last = i + 1 == len(layers)
            gamma_next = self.norm.weight if last else layers[i + 1].attention_norm.weight
            # calibration step: the producer quantized with the current amax, and so must the consumer
            inv_attn = inv_scale_from_amax(amaxes[-1]) if inv[2 * i] is None else inv[2 * i]
            inv_next = None if last else inv[2 * i + 2]
            x, h, rstd, hq, amax_ffn, amax_next = layer(
                x, h, rstd, freqs, seqlen, gamma_next, cfg,
                fp8=(hq, inv_attn, inv[2 * i + 1], inv_next, last, wqkv_q[i], s_qkv[i],
                     wqkv_qt[i] if qkv_dgrad else None, w13_q[i], s_13[i],
                     w13_qt[i] if mlp_dgrad else None, inv_g[i], sink[i], mlp_wgrad),
            )
            amaxes += [amax_ffn] if last else [amax_ffn, amax_next]
        if self.training:
            self._fp8_record(amaxes)
        return x, h, rstd

    def _fp8_grad_sites(self, device, enabled: bool):
        """fp8_mlp_dgrad / fp8_mlp_wgrad: (per-layer delayed inverse e5m2 scales, or Nones to calibrate, and a fresh
        per-layer sink whose gradient will hold the amax of each layer's da). First moves the amaxes
        that the last backward left in the previous sink into the history."""
        n = self.fp8_grad_amax_history.shape[0]
        if self._fp8_grad_sink is not None and self._fp8_grad_sink.grad is not None:
            hist = self.fp8_grad_amax_history
            new = self._fp8_grad_sink.grad.to(device=hist.device, dtype=hist.dtype)
            hist.copy_(torch.cat([new[:, None], hist[:, :-1]], dim=1))
            self.fp8_grad_calibrated = True
        self._fp8_grad_sink = None
        if not enabled:
            return [None] * n, [None] * n
        if self.fp8_grad_calibrated:
            headroom = 2.0 ** self.model_args.fp8_grad_margin  # (a step's amax may outgrow the history)
            inv = list(inv_scale_from_amax(self.fp8_grad_amax_history.amax(-1) * headroom, E5M2_MAX).unbind(0))
        else:
            inv = [None] * n
        self._fp8_grad_sink = torch.zeros(n, device=device, dtype=torch.float32, requires_grad=True)
        with torch.enable_grad():
            return inv, list(self._fp8_grad_sink.unbind(0))

    @torch.no_grad()
    def _fp8_record(self, amaxes) -> None:
        hist = self.fp8_amax_history
        new = torch.stack([a.to(hist.dtype) for a in amaxes])
        hist.copy_(torch.cat([new[:, None], hist[:, :-1]], dim=1))
        self.fp8_calibrated = True
