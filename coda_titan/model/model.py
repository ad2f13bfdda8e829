"""The CODA LLaMA-3 model: TorchTitan's llama3 parameters, CODA's program graph.

Parameters, their names, shapes and initialization are inherited from TorchTitan's ``Transformer``,
so checkpoints and state dicts move between ``llama3`` and ``coda_llama3`` both ways. Only the
forward differs: it runs the GEMM-plus-epilogue programs of CODA.md.

Program chain (one row of tokens; r = deferred rstd, H = X * gamma, S = partial sums of X^2):

    prologue:  X0 = embed(tokens); H, S = rms_partial(X0, gamma_attn[0]); r = rstd_finalize(S)
    layer l:   qkv = norm_rope(H, r)                          # F3: QKV GEMM + rstd + RoPE
               o   = attention(qkv)                           # SDPA, or FA4 on the packed qkv
               X, H, S = residual_rms(o, Wo, X, gamma_ffn[l]) # F1; r = rstd_finalize(S)
               X, H, S = norm_swiglu -> residual_rms(W2, gamma_next)   # F2 -> F1; r = ...
    head:      loss = lm_head_ce(H, r)                        # F4: chunked LM head + CE (+ its gradient)

precision = "fp8" runs the same chain with e4m3 operands (``LayerFp8``; scales in ``fp8_scaling``).

The paper draws a fused block from layer l's out-projection to layer l+1's QKV; this is the same
chain of programs cut at attention instead, so that each ``layers.{l}`` module runs on exactly the
weights it owns (its FSDP/compile/AC unit) plus the next norm's gamma (d floats), which F1's
epilogue needs to write H.
"""

from __future__ import annotations

import dataclasses

import torch

from torchtitan.models.llama3.model.model import Transformer, TransformerBlock

from ..kernels import get_backend, resolve_backend
from ..kernels.scaling import inv_scale_from_amax
from ..titan.fa4 import attention_on_packed
from ..titan.job_config import validate
from .args import CodaModelArgs
from .autograd import LMHeadCE, NormRoPE, NormSwiGLUResidual, ProgramConfig, ResidualRMS
from .fp8_operands import Fp8Input, Fp8Operands, LayerFp8, MlpFp8, QuantizeH
from . import weight_prefetch
from .fp8_scaling import Fp8Scaling, aligned_unbind
from .precision import amp_dtype
from .rope import rope_freqs
from .storage import stack_layer_weights
from .weight_prefetch import is_sharded as _is_sharded


class CodaTransformerBlock(TransformerBlock):
    """One layer as programs: F3 -> attention -> F1(Wo) -> F2 -> F1(W2). Same parameters as stock."""

    def forward(self, x, h, rstd, freqs, seqlen: int, gamma_next, cfg: ProgramConfig, fp8: LayerFp8 | None = None):
        """Returns (x, h, rstd); with ``fp8`` also (hq_next, amax_ffn, amax_next, amax_y, amax_o, hq_t_next, tok, amax_pre):
        the e4m3 H of the next layer, the amaxes of this layer's MLP input, of the next layer's input and
        (with ``fp8.down`` / ``fp8.out``, else None) of the down- and out-projections' inputs, with
        ``fp8.qkv_h_t`` the next layer's Hq^T (hq_next, amax_next and hq_t_next None on the last layer), and the
        MLP's amax token for the next layer's F3 (``edges.amax_token``; None unless ``fp8.mlp_amax``), amax |a| (``fp8.preact``)."""
        # x, h: (M, dim) with M = bs * seqlen; rstd: (M,); freqs: (head_dim/2,) fp64
        attn, hd, w = self.attention, self.attention.head_dim, cfg.weight
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        qkv, x = NormRoPE.apply(h, rstd, x, w(self.attention_norm.weight), w(attn.wq.weight), w(attn.wk.weight),
                                w(attn.wv.weight), freqs, seqlen, cfg, n_q + n_kv, hd,
                                *(() if fp8 is None else (fp8.attn, fp8.qkv_grad_sink, fp8.amax_tok)))
        o = attention_on_packed(attn.inner_attention, qkv, seqlen, n_q, n_kv, attn.enable_gqa)  # (M, n_heads * head_dim)
        ff = self.feed_forward
        mlp_weights = (w(self.ffn_norm.weight), w(ff.w1.weight), w(ff.w3.weight), w(ff.w2.weight), gamma_next)
        if fp8 is None:
            x, h, s = ResidualRMS.apply(o, w(attn.wo.weight), x, mlp_weights[0], cfg)
            rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
            x, h, s = NormSwiGLUResidual.apply(h, rstd, x, *mlp_weights, cfg)
            rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
            return x, h, rstd
        out = ResidualRMS.apply(o, attn.wo.weight, x, self.ffn_norm.weight, cfg, QuantizeH(fp8.inv_ffn, fp8.mlp_h_t), fp8.out)
        out, tok_o = (out[:-1], out[-1]) if fp8.out is not None and fp8.out.grad_amax else (out, None)
        x, h, s, hq, amax_ffn = out[:5]
        amax_o, hq_t = out[-1] if fp8.out is not None else None, out[5] if fp8.mlp_h_t else None
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        inv_ffn = inv_scale_from_amax(amax_ffn) if fp8.inv_ffn is None else fp8.inv_ffn  # calibration: current
        mlp = MlpFp8(
            f2=Fp8Operands(hq=hq, inv_a=inv_ffn, w=fp8.w13, s_w=fp8.s_13, w_t=fp8.w13_t),
            quantize_next=None if fp8.last else QuantizeH(fp8.inv_next, fp8.qkv_h_t),
            grad_inv_scale=fp8.grad_inv_scale, h_amax=amax_ffn if fp8.mlp_wgrad else None, down=fp8.down,
            w2_t=fp8.w2_t, s_w2=fp8.s_w2, hq_t=hq_t, grad_amax=fp8.mlp_amax, preact=fp8.preact, inv_pre=fp8.inv_pre,
        )
        out = NormSwiGLUResidual.apply(h, rstd, x, *mlp_weights, cfg, mlp, fp8.grad_sink, tok_o)
        out, tok = (out[:-1], out[-1]) if fp8.mlp_amax else (out, None)
        out, amax_pre = (out[:-1], out[-1]) if fp8.preact else (out, None)
        x, h, s = out[:3]
        hq_next, amax_next = (None, None) if fp8.last else out[3:5]
        amax_y = out[-1] if fp8.down is not None else None
        hq_t_next = out[5] if fp8.qkv_h_t and not fp8.last else None
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        return x, h, rstd, hq_next, amax_ffn, amax_next, amax_y, amax_o, hq_t_next, tok, amax_pre


def _no_wait(layer: int | None) -> None:
    """Without ``[coda] optimizer_stream`` the step is ordered before the forward on one stream."""


def _attention_gammas(layers: list[torch.nn.Module], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Every block's attention-norm gamma, each read by the program before that block (the previous
    block's F1 epilogue, or the prologue) to write H = X * gamma.

    Unsharded, these are the parameters. Under FSDP2 a block's parameters are sharded until its own
    forward gathers them, so the gammas (d values per block) are gathered here, once per forward, in
    one collective over the shards of all blocks, cast to FSDP's parameter dtype first (the values
    FSDP's own all-gather gives). Gathering whole blocks early instead (``unshard()``) runs their
    all-gathers on the compute stream, where FSDP's own run beside the compute (docs/history.md).
    The copies carry no gradient (H is not differentiated); gamma's gradient comes from the block's
    own norm backward (B2), in its own FSDP unit."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    weights = [layer.attention_norm.weight for layer in layers]
    sharded = [i for i, w in enumerate(weights) if isinstance(w, DTensor)]
    if not sharded:
        return weights
    w0 = weights[sharded[0]]
    mesh, placements = w0.device_mesh, w0.placements
    if any(weights[i].device_mesh != mesh or weights[i].placements != placements for i in sharded):
        gathered = [weights[i].full_tensor() for i in sharded]  # (not FSDP2's layout: one by one)
    else:
        with torch.no_grad():
            local = torch.stack([weights[i].to_local() for i in sharded])
            if dtype is not None:
                local = local.to(dtype)
            stacked = DTensor.from_local(
                local, mesh, [Shard(1) if isinstance(q, Shard) else Replicate() for q in placements],
                run_check=False, shape=(len(sharded), w0.shape[0]), stride=(w0.shape[0], 1),
            )
            gathered = list(stacked.full_tensor().unbind(0))
    out = list(weights)
    for i, g in zip(sharded, gathered):
        out[i] = g.to(dtype) if dtype is not None else g
    return out


class LMHead(torch.nn.Module):
    """TorchTitan's ``output`` projection, the same parameter under the same name (``output.weight``,
    (vocab, dim)), whose forward runs CODA's LM-head program: F4 (chunked LM head + CE) with labels,
    the logits without. The program runs in this module's forward so that the projection can be an
    FSDP2 unit of its own, as in TorchTitan: gathered by its own hooks when the head starts and its
    gradient reduce-scattered as soon as the head's backward ends, beside the blocks' backward."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__()
        self.in_features, self.out_features = dim, vocab_size
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, h, rstd, x=None, norm_weight=None, labels=None, cfg: ProgramConfig | None = None):
        weight = self.weight if self.weight.dtype == h.dtype else self.weight.to(h.dtype)  # (AMP: ProgramConfig.weight)
        if labels is None:
            return (h @ weight.t()).to(rstd.dtype) * rstd[:, None]
        compute_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, self.weight))
        return LMHeadCE.apply(h, rstd, x, norm_weight, weight, labels, cfg, compute_grad)


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
        coda = validate(model_args.coda)
        self.backend_name = resolve_backend(coda.backend)
        self.layers = torch.nn.ModuleDict(
            {str(i): CodaTransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        if self.output is not None:
            self.output = LMHead(model_args.dim, model_args.vocab_size)
        self._freqs_cache: dict[torch.device, torch.Tensor] = {}
        self.fp8_scaling = Fp8Scaling(model_args.n_layers, coda.fp8_amax_history, coda.fp8_grad_margin, coda.fp8_act_margin)

    def init_weights(self, buffer_device=None):
        super().init_weights(buffer_device=buffer_device)
        self.fp8_scaling.reset(buffer_device or self.fp8_scaling.activation_history.device)
        if self.model_args.coda.stacked_weights:
            stack_layer_weights(self.layers.values())

    def program_config(self) -> ProgramConfig:
        a = self.model_args
        return ProgramConfig(
            backend=get_backend(self.backend_name, traced=a.coda.trace_passes), tile_n=a.coda.tile_n, eps=a.norm_eps,
            ce_chunk_rows=a.coda.ce_chunk_rows, fp8_wgrads=a.coda.precision == "fp8" and a.coda.fp8_layer_wgrads,
            fp8_da_wgrad=a.coda.fp8_mlp_wgrad_e5m2, fp8_y_wgrad=a.coda.fp8_down_wgrad, fp8_da_t=a.coda.fp8_mlp_da_t,
            fp8_qkv_wgrad=a.coda.precision == "fp8" and a.coda.fp8_qkv_wgrad,
            fp8_out_bwd=a.coda.precision == "fp8" and a.coda.fp8_out_bwd, fp8_weight_t_bwd=a.coda.fp8_weight_t_bwd,
            fp8_lm_head=a.coda.precision == "fp8" and a.coda.fp8_lm_head,
            fp8_lm_head_fwd=a.coda.precision == "fp8" and a.coda.fp8_lm_head_fwd, fp8_lm_head_dw=a.coda.fp8_lm_head_dw,
            fp8_lm_head_dgrad=a.coda.fp8_lm_head_dgrad, stacked_weights=a.coda.stacked_weights)

    def _freqs(self, device: torch.device) -> torch.Tensor:
        """TorchTitan's per-pair RoPE frequencies (Llama-3.1 scaling applied), fp64, on ``device``."""
        if device not in self._freqs_cache:
            a = self.model_args
            self._freqs_cache[device] = rope_freqs(a.dim // a.n_heads, a.rope_theta, a.rope_scaling_args).to(device)
            if a.coda.cuda_graphs:  # a graph input read at its address (the programs key their tables on it)
                torch._dynamo.mark_static_address(self._freqs_cache[device])
        return self._freqs_cache[device]

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions=None, labels=None):
        """The program chain runs with autocast off: each program's precision is its operands' dtypes and its
        accumulators' (fp32), which autocast would change (the reference's GEMMs rounded to bf16 before
        their epilogues). Under AMP the parameters come to the programs cast to autocast's dtype (``precision``)."""
        if attention_masks is not None or positions is not None:
            raise NotImplementedError("coda_llama3 runs causal SDPA on contiguous positions only")
        amp = amp_dtype(self.tok_embeddings, tokens.device, self.model_args.coda.precision)
        with torch.autocast(tokens.device.type, enabled=False):
            return self._forward(tokens, labels, amp)

    def _forward(self, tokens, labels, amp: torch.dtype | None):
        # ([coda] optimizer_stream: the last step, on its stream; with step_chunk_layers each block waits for its own chunk)
        step_wait = getattr(getattr(self, "optimizer_stream", None), "wait_for", _no_wait)
        step_wait(-1)  # (the embedding and the norms)
        cfg = self.program_config()
        cfg = cfg if amp is None else dataclasses.replace(cfg, amp_dtype=amp)
        bs, seqlen = tokens.shape
        x = self.tok_embeddings(tokens).view(bs * seqlen, -1)  # (M, dim)
        x = x if amp is None else x.to(amp)
        freqs = self._freqs(x.device)
        layers = list(self.layers.values())
        blocks = self._blocks(layers, tokens.is_cuda)
        fp8 = self.model_args.coda.precision == "fp8" and bool(layers)
        with torch.no_grad():  # prologue: H and S are non-differentiable by construction
            gammas = [cfg.weight(g) for g in _attention_gammas(layers, getattr(self, "fsdp_param_dtype", None))]
            gamma0 = gammas[0] if layers else cfg.weight(self.norm.weight)
            if fp8:
                inv = self.fp8_scaling.activation_inv_scales()
                h, s, hq, amax0 = cfg.backend.rms_partial_fp8(x=x, gamma=gamma0, tile_n=cfg.tile_n, inv_scale=inv[0])
            else:
                h, s = cfg.backend.rms_partial(x=x, gamma=gamma0, tile_n=cfg.tile_n)
        rstd = cfg.backend.rstd_finalize(partials=s, dim=x.shape[1], eps=cfg.eps)
        if fp8:
            x, h, rstd = self._fp8_layers(x, h, hq, amax0, inv, rstd, freqs, seqlen, cfg, layers, gammas, blocks, step_wait)
        else:
            for i, block in enumerate(blocks):
                gamma_next = gammas[i + 1] if i + 1 < len(layers) else cfg.weight(self.norm.weight)
                step_wait(i)
                x, h, rstd = block(x, h, rstd, freqs, seqlen, gamma_next, cfg)
        step_wait(None)  # (the LM head: the whole step, and the backward after it)
        if labels is None:
            return self.output(h, rstd).to(h.dtype).view(bs, seqlen, -1)
        return self.output(h, rstd, x, cfg.weight(self.norm.weight), labels.reshape(-1), cfg)

    def _blocks(self, layers, cuda: bool) -> list:
        """What the forward calls per layer. With ``[coda] cuda_graphs`` the first forward runs the blocks
        uncompiled, so what the programs make once and keep (RoPE tables, autotuning) is made outside
        the graphs' memory pool (whose live tensors must all be graph outputs); later ones start a step."""
        if not (self.model_args.coda.cuda_graphs and cuda):
            return layers
        if getattr(self, "_graphs_warm", False):
            torch.compiler.cudagraph_mark_step_begin()
            return layers
        self._graphs_warm = True
        return [getattr(layer, "_orig_mod", layer) for layer in layers]

    def _weight_pass_flags(self, grad: bool) -> tuple:
        """What the fp8 weight pass makes: (W13^T for B2's fp8 dgrad, W_qkv^T for F3's, W2^T for B3's,
        the F1 input sites on an fp8 mainloop, W_o^T for its fp8 backward). The transposed weights serve
        the backward only."""
        coda = self.model_args.coda
        mlp_dgrad = coda.fp8_mlp_dgrad and grad
        down_dgrad = coda.fp8_down_dgrad and mlp_dgrad  # B3 on fp8 needs the e5m2 B3 (its gradient site)
        sites = tuple(site for site, on in (("down", coda.fp8_down_proj), ("out", coda.fp8_out_proj)) if on)
        return mlp_dgrad, coda.fp8_dgrad and grad, down_dgrad, sites, coda.fp8_out_bwd and grad and "out" in sites

    def _scale_sites(self, flags: tuple) -> tuple[str, ...]:
        """The delayed input sites a forward with these ``_weight_pass_flags`` reads: the F1 inputs on an fp8
        mainloop, and "preact" where F2 saves a as e4m3 for the fp8 B3 (``fp8_preact``; a training forward's)."""
        return (*flags[3], *(("preact",) if self.model_args.coda.fp8_preact and flags[2] else ()))

    @staticmethod
    def _weight_pass(blocks, cfg: ProgramConfig, flags: tuple) -> tuple:
        """Every e4m3 weight the forward (and, transposed, the backward) of ``blocks`` reads:
        straight-through, the backward's own GEMMs use the bf16 weights. Scales come one 0-dim tensor per layer."""
        mlp_dgrad, qkv_dgrad, down_dgrad, sites, out_bwd = flags
        weight = {"down": lambda l: l.feed_forward.w2.weight, "out": lambda l: l.attention.wo.weight}
        transposed = {"down": down_dgrad, "out": out_bwd}  # (W2^T: B3's K-major operand; W_o^T: its fp8 dgrad's)
        lazy = cfg.fp8_weight_t_bwd  # (no transposes here: each backward makes its own from W's codes, passed instead)
        with torch.no_grad():
            ws = cfg.backend.fp8_layer_weights(
                w1=[l.feed_forward.w1.weight for l in blocks], w3=[l.feed_forward.w3.weight for l in blocks],
                wq=[l.attention.wq.weight for l in blocks], wk=[l.attention.wk.weight for l in blocks],
                wv=[l.attention.wv.weight for l in blocks], w13_t=mlp_dgrad and not lazy, wqkv_t=qkv_dgrad and not lazy,
            )
            fp8_in = {site: cfg.backend.fp8_weights(ws=[weight[site](l) for l in blocks], transposed=transposed[site] and not lazy)
                      for site in sites}
            down = fp8_in.get("down") or down_dgrad and cfg.backend.fp8_weights(ws=[weight["down"](l) for l in blocks], transposed=not lazy)
            w2_t = (down[0] if lazy else down[2], aligned_unbind(down[1])) if down_dgrad else None
            w13, s_13, wqkv, s_qkv, w13_t, wqkv_t = ws  # each layer's scale 16-byte aligned (``aligned_unbind``)
            if lazy:
                w13_t, wqkv_t = (w13 if mlp_dgrad else []), (wqkv if qkv_dgrad else [])
            fp8_in = {site: (q, aligned_unbind(sc), (q if lazy and out_bwd else q_t) if site == "out" else [])
                      for site, (q, sc, q_t) in fp8_in.items()}
            return w13, aligned_unbind(s_13), wqkv, aligned_unbind(s_qkv), w13_t, wqkv_t, fp8_in, w2_t

    def prefetch_fp8_weights(self) -> bool:
        """Issue the next training forward's delayed scales and fp8 weight pass now (an optimizer-step
        post-hook, ``titan.train_spec``; ``weight_prefetch``). Returns whether a pass was issued."""
        return weight_prefetch.begin(self) and weight_prefetch.issue(self)

    def prefetch_fp8_chunk(self, start: int | None = None, stop: int | None = None) -> None:
        """The chunked step's (``titan.opt_stream.chunked_step``): ``start`` None takes the scales at the step's
        start, else the pass over ``layers[start:stop]`` after their update."""
        if start is None:
            weight_prefetch.begin(self)
        else:
            weight_prefetch.issue(self, start, stop)

    def _take_prefetched(self, layers, flags: tuple):
        """``layer -> (weight-pass tuple, index)`` over the prefetched passes if they hold for this forward (else None), once."""
        return weight_prefetch.take(self, layers, flags)

    def _fp8_layers(self, x, h, hq, amax0, inv, rstd, freqs, seqlen, cfg, layers, gammas, blocks, step_wait):
        """The layer chain with e4m3 F2/F3 operands (and the F1s of W2 / W_o with ``fp8_down_proj`` /
        ``fp8_out_proj``). Site 2i is layer i's attention input, 2i + 1 its MLP input (and the input
        sites "down" / "out" i its SwiGLU / attention output); a training forward records each site's
        current amax in its history."""
        amaxes = [amax0]
        coda = self.model_args.coda
        grad = torch.is_grad_enabled()  # (the transposed weights and gradient sites serve the backward only)
        flags = self._weight_pass_flags(grad)
        mlp_dgrad, mlp_wgrad, inputs = flags[0], coda.fp8_mlp_wgrad and grad, flags[3]
        h_t = coda.fp8_mlp_h_t and mlp_dgrad and mlp_wgrad and coda.fp8_mlp_wgrad_e5m2 and "out" in inputs  # (dW13's)
        qkv_h_t = coda.fp8_qkv_wgrad and grad and "down" in inputs  # (dW_qkv's; layer 0's from the prologue's codes)
        hq_t = hq.t().contiguous() if qkv_h_t else None

        def weight_pass(blocks):
            return self._weight_pass(blocks, cfg, flags)

        # batched passes over every layer (issued by the last optimizer step, whole or per chunk, if they still
        # hold: weight_prefetch), else one of its own; under FSDP2 each block's own, once its weights are gathered
        sharded = _is_sharded(layers[0])
        batched = None if sharded else self._take_prefetched(layers, flags)
        if batched is None and not sharded:  # (its own pass reads every layer's weights: after the whole step)
            step_wait(None)
            ws_all = weight_pass(layers)
            batched = lambda i: (ws_all, i)  # noqa: E731

        def layer_weights(i, layer):
            """(W13q, s_13, W_qkv,q, s_qkv, W13q^T or None, W_qkv,q^T or None, {site: (e4m3 weight, its
            scale, its transpose or None)} of the F1 input sites on, (W2q^T, s_w2) or None) of layer i."""
            if sharded:  # the block's own gather (at i > 0 issued at block i - 1), then the next block's,
                layer.unshard()  # asynchronously: it runs beside this block's compute, as FSDP's prefetch does
                if i + 1 < len(layers):
                    layers[i + 1].unshard(async_op=True)
            ws, j = (weight_pass([layer]), 0) if sharded else batched(i)
            w13, s_13, wqkv, s_qkv, w13_t, wqkv_t, fp8_in, w2_t = ws
            return (w13[j], s_13[j], wqkv[j], s_qkv[j], w13_t[j] if w13_t else None, wqkv_t[j] if wqkv_t else None,
                    {site: (q[j], sc[j], q_t[j] if q_t else None) for site, (q, sc, q_t) in fp8_in.items()},
                    None if w2_t is None else (w2_t[0][j], w2_t[1][j]))

        with torch.no_grad():  # B3 writes e5m2 da (and B1 F3's with fp8_dgrad)
            sites = self.fp8_scaling.gradient_sites(x.device, mlp_dgrad or mlp_wgrad, qkv=flags[1])
        (inv_g, sinks), (inv_q, sinks_q) = sites["mlp"], sites["qkv"]
        inputs_and_a = self._scale_sites(flags)
        preact = "preact" in inputs_and_a
        inv_in = {site: self.fp8_scaling.input_inv_scales(site) for site in inputs_and_a}
        amaxes_in = {site: [] for site in inputs_and_a}
        tok = None  # (the layer below's MLP amax token)
        for i, layer in enumerate(layers):
            w13, s_13, wqkv, s_qkv, w13_t, wqkv_t, w_in, w2_t = layer_weights(i, layer)
            # (edges.amax_token: W_o's gradient cast takes the MLP's B2's amax, the MLP's the next layer's F3's)
            f1_in = {site: Fp8Input(w=w, s_w=sc, inv=inv_in[site][i], w_t=w_t,
                                    grad_amax=site == "out" and coda.fp8_out_bwd and w_t is not None)
                     for site, (w, sc, w_t) in w_in.items()}
            last = i + 1 == len(layers)
            gamma_next = self.norm.weight if last else gammas[i + 1]
            # calibration step: the producer quantized with the current amax, and so must the consumer
            inv_attn = inv_scale_from_amax(amaxes[-1]) if inv[2 * i] is None else inv[2 * i]
            fp8 = LayerFp8(
                attn=Fp8Operands(hq=hq, inv_a=inv_attn, w=wqkv, s_w=s_qkv, w_t=wqkv_t, grad_inv=inv_q[i], hq_t=hq_t),
                qkv_grad_sink=sinks_q[i], qkv_h_t=qkv_h_t,
                inv_ffn=inv[2 * i + 1], inv_next=None if last else inv[2 * i + 2], last=last,
                w13=w13, s_13=s_13, w13_t=w13_t,
                grad_inv_scale=inv_g[i], grad_sink=sinks[i], mlp_wgrad=mlp_wgrad,
                down=f1_in.get("down"), out=f1_in.get("out"),
                w2_t=None if w2_t is None else w2_t[0], s_w2=None if w2_t is None else w2_t[1], mlp_h_t=h_t,
                mlp_amax=not last and sinks[i] is not None and w2_t is not None, amax_tok=tok,
                preact=preact, inv_pre=inv_in["preact"][i] if preact else None,
            )
            step_wait(i)
            x, h, rstd, hq, amax_ffn, amax_next, amax_y, amax_o, hq_t, tok, amax_pre = blocks[i](
                x, h, rstd, freqs, seqlen, gamma_next, cfg, fp8)
            amaxes += [amax_ffn] if last else [amax_ffn, amax_next]
            for site, amax in (("down", amax_y), ("out", amax_o), ("preact", amax_pre)):
                if site in inputs_and_a:
                    amaxes_in[site].append(amax)
        if self.training:
            self.fp8_scaling.record_activations(amaxes)
            for site, amaxes_site in amaxes_in.items():
                self.fp8_scaling.record_input(site, amaxes_site)
        return x, h, rstd
