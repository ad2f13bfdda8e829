"""``liger_llama3``: stock TorchTitan llama3 with Liger's kernels where Liger has them, a baseline to compare with.

Liger (``liger-kernel``, Triton) is what many of our users would reach for instead of CODA: unfused GEMMs with
fused elementwise kernels around them, and a fused linear cross-entropy that never holds the whole logits. This
train spec is TorchTitan's llama3 (its model class, parameters, names, initialization, parallelize function,
optimizers and checkpoints) with
- every RMSNorm (each block's two and the final one) running Liger's RMSNorm kernel (``casting_mode = "llama"``,
  Liger's default for Llama, forward and backward),
- each block's SwiGLU ``silu(w1 x) * w3 x`` running Liger's SiLU-mul kernel (the three GEMMs stay cuBLAS's),
- the LM head and the loss as Liger's fused linear cross-entropy (chunked, its gradients made in the forward),
  summed over the tokens with TorchTitan's ignore index, as TorchTitan's ``cross_entropy_loss``; the LM head's
  weight gradient summed over the chunks in fp32 (Liger's ``accum_dtype``), as stock's one GEMM accumulates.
RoPE stays TorchTitan's: Liger's RoPE kernel rotates HF's half-split layout, while TorchTitan's llama3 rotates
interleaved pairs; using it would mean permuting wq and wk, and checkpoints would no longer be llama3's.

Like ``coda_llama3``, the model takes the labels in its forward (``train_spec.LabelsInInputs``) and returns the
0-dim loss; called without labels (TorchTitan's validator) it returns logits for the stock loss. Attention is the
config's (``converters = ["fa4"]`` in the 1B configs). Liger runs on CUDA only: the spec refuses in one line where
its kernels cannot run (``liger_unavailable_reason``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
from torch import nn

from torchtitan.models.llama3.model.model import FeedForward, Transformer

NAME = "liger_llama3"
IGNORE_INDEX = -100  # (TorchTitan's ``components.loss.IGNORE_INDEX``)


@dataclasses.dataclass(frozen=True)
class LigerOps:
    """The three kernels the model calls: ``rms_norm(x, w, eps)``, ``silu_mul(a, b)``, ``linear_ce(h, w, t)`` (the
    summed cross-entropy of h @ w^T against t). ``liger_ops`` gives Liger's; the CPU tests give torch's own math."""

    rms_norm: Callable
    silu_mul: Callable
    linear_ce: Callable


def liger_unavailable_reason() -> str | None:
    """Why Liger's kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "Liger's kernels (Triton) need a CUDA GPU and there is none here"
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
    except Exception as e:  # ImportError, or Triton failing to load
        return f"liger-kernel is not importable ({type(e).__name__}: {e}); pip install 'coda_titan[liger]'"
    return None


TORCH_OPS_ENV = "CODA_TITAN_LIGER_TORCH_OPS"  # a probe's bisection: "rms_norm,linear_ce" runs those two as torch's


def torch_ops() -> LigerOps:
    """torch's own math for the three kernels (the CPU tests', and the bisection arms' of ``TORCH_OPS_ENV``)."""

    def linear_ce(h, w, t):
        logits = (h @ w.t()).float()
        return torch.nn.functional.cross_entropy(logits, t, reduction="sum", ignore_index=IGNORE_INDEX)

    return LigerOps(rms_norm=lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps),
                    silu_mul=lambda a, b: torch.nn.functional.silu(a) * b, linear_ce=linear_ce)


def liger_ops(torch_names: list[str] | None = None, rms_in_place: bool = True) -> LigerOps:
    """Liger's kernels, as its own Llama modules call them; those named in ``torch_names`` (by default in
    ``CODA_TITAN_LIGER_TORCH_OPS``, comma-separated: a probe's bisection of the kernels; field names of ``LigerOps``)
    as torch's math instead. ``rms_in_place=False``: the RMSNorm backward writes dX to a buffer of its own (a
    probe's arm; Liger's Llama default is in place)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    # (dW_out summed over the chunks in fp32, as stock's one GEMM accumulates; by default Liger rounds the running
    # sum of its 32 chunks of the 1B step to the weight's bf16 after each: docs/design.md, "The baselines")
    flce = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX, accum_dtype=torch.float32)
    ops = LigerOps(
        rms_norm=lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", rms_in_place),
        silu_mul=LigerSiLUMulFunction.apply,
        linear_ce=lambda h, w, t: flce(w, h, t),
    )
    swap = [n for n in os.environ.get(TORCH_OPS_ENV, "").split(",") if n] if torch_names is None else torch_names
    unknown = set(swap) - {f.name for f in dataclasses.fields(LigerOps)}
    if unknown:
        raise ValueError(f"{TORCH_OPS_ENV} names {sorted(unknown)}; it takes rms_norm, silu_mul, linear_ce")
    plain = torch_ops()
    return dataclasses.replace(ops, **{n: getattr(plain, n) for n in swap})


OPS: LigerOps | None = None  # (resolved once, at the first model built; tests set it to torch's math)


def _ops() -> LigerOps:
    global OPS
    if OPS is None:
        why = liger_unavailable_reason()
        if why is not None:
            raise RuntimeError(f"model.name = {NAME!r}: {why}; use model.name = \"llama3\" for the stock model")
        OPS = liger_ops()
    return OPS


class LigerRMSNorm(nn.RMSNorm):
    """TorchTitan's ``nn.RMSNorm`` (the same parameter, init and state) on Liger's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops().rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


class LigerFeedForward(FeedForward):
    """TorchTitan's SwiGLU feed-forward, its gate and up products combined by Liger's SiLU-mul kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_ops().silu_mul(self.w1(x), self.w3(x)))


class LigerLMHead(nn.Linear):
    """TorchTitan's output projection; given labels, the summed cross-entropy of its logits by Liger's fused
    linear cross-entropy instead (run through this module so that FSDP2's hooks gather its weight)."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return _ops().linear_ce(h.flatten(0, 1), self.weight, labels.flatten(0, 1))


class LigerTransformer(Transformer):
    """Stock llama3 with Liger's RMSNorm, SiLU-mul and fused linear cross-entropy (module docstring)."""

    def __init__(self, model_args):
        super().__init__(model_args)
        _ops()  # (refuses here, before any weight is allocated, where Liger cannot run)
        for module in self.modules():
            if type(module) is nn.RMSNorm:
                module.__class__ = LigerRMSNorm
            elif type(module) is FeedForward:
                module.__class__ = LigerFeedForward
        self.output.__class__ = LigerLMHead

    def forward(self, tokens, attention_masks=None, positions=None, labels=None):
        """The 0-dim loss sum over the labelled tokens with ``labels``, else the logits (as stock llama3's)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h, labels)


def get_train_spec():
    """TorchTitan llama3's TrainSpec with the Liger model, the labels in the model's inputs and the loss the
    model returns (``train_spec.build_coda_loss`` passes a 0-dim loss through)."""
    from torchtitan.models.llama3 import llama3_args

    from .train_spec import build_coda_dataloader, build_coda_loss, stock_llama3_spec

    return dataclasses.replace(stock_llama3_spec(), model_cls=LigerTransformer, model_args=llama3_args,
                               pipelining_fn=None, build_dataloader_fn=build_coda_dataloader,
                               build_loss_fn=build_coda_loss)
