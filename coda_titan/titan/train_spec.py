"""The ``coda_llama3`` TrainSpec: TorchTitan's llama3 pieces, CODA's model and loss placement.

The CODA model computes the loss inside its last program (chunked LM head + CE), so it needs the
labels in its forward. The dataloader is TorchTitan's own text dataloader; ``LabelsInInputs``
only adds the labels to the input dict, which the Trainer passes to the model as keyword inputs.
Batches, order and dataloader checkpoint state are identical to stock ``llama3``'s.
The loss function returns the model's loss sum as is, or takes the stock cross-entropy of logits (the
validator calls the model without labels).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.components.validate import build_validator
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.models.llama3 import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.tools.logging import logger

from ..model.args import coda_llama3_args
from ..model.model import CodaTransformer
from . import coda_adamw, fused_clip, opt_stream
from .parallelize import parallelize_coda

NAME = "coda_llama3"


class LabelsInInputs(Stateful):
    """Wraps a TorchTitan dataloader; yields ({"input", "labels"}, labels)."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        for input_dict, labels in self.inner:
            yield {**input_dict, "labels": labels}, labels

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def build_coda_dataloader(**kwargs):
    return LabelsInInputs(build_text_dataloader(**kwargs))


def build_coda_optimizers(model_parts, *args, **kwargs):
    """TorchTitan's optimizers, with a post-step hook that issues each CODA model's next fp8 weight
    pass (``CodaTransformer.prefetch_fp8_weights``; a no-op unless precision = "fp8"), with ``[coda]
    fused_clip`` the clip's scale applied in the step (``fused_clip``), with ``[coda] coda_adamw`` the step as one
    Triton launch (``coda_adamw``), and with ``[coda]
    optimizer_stream`` the step on a stream of its own (``opt_stream``; its hooks go last), in layer chunks
    with ``[coda] step_chunk_layers`` (each chunk's weight pass issued after its update)."""
    optimizers = build_optimizers(model_parts, *args, **kwargs)
    parts = [m for m in model_parts if isinstance(m, CodaTransformer)]
    streamed = bool(parts) and all(m.model_args.coda.optimizer_stream for m in parts)
    per_chunk = parts[0].model_args.coda.step_chunk_layers if streamed else 0
    if parts and not per_chunk:  # (chunked, the step issues each chunk's pass itself)
        optimizers.register_step_post_hook(lambda *_: [m.prefetch_fp8_weights() for m in parts])
    if parts and all(m.model_args.coda.coda_adamw for m in parts):
        coda_adamw.install(optimizers)
    if parts and all(m.model_args.coda.fused_clip for m in parts):
        fused_clip.install(optimizers, model_parts)
    if streamed:
        opt_stream.install(optimizers, model_parts, per_chunk)
    return optimizers


def build_coda_loss(job_config, **kwargs):
    # Compiling "loss" only concerns the validation path (logits); the training loss is a program.
    stock = build_cross_entropy_loss(job_config, **kwargs)

    def loss_fn(pred, labels):
        # pred is 0-dim when the model already ran the LM-head + CE program (the training path)
        return pred if pred.dim() == 0 else stock(pred, labels)

    return loss_fn


def build_tokenizer(job_config, **kwargs):
    """TorchTitan's HF tokenizer, with a ``coda:stdlib-bpe-<vocab>`` ``model.hf_assets_path`` resolved
    (built on first use, then cached), so the shipped configs run under TorchTitan's own launcher too."""
    from .data import ensure_tokenizer

    job_config.model.hf_assets_path = ensure_tokenizer(job_config.model.hf_assets_path, log=logger.info)
    return build_hf_tokenizer(job_config, **kwargs)


def stock_llama3_spec() -> TrainSpec:
    """Stock ``llama3``'s TrainSpec with ``build_tokenizer`` (everything else is TorchTitan's own)."""
    from torchtitan.models.llama3 import get_train_spec as stock

    return dataclasses.replace(stock(), build_tokenizer_fn=build_tokenizer)


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=CodaTransformer,
        model_args=coda_llama3_args,
        parallelize_fn=parallelize_coda,
        pipelining_fn=None,
        build_optimizers_fn=build_coda_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_coda_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_coda_loss,
        build_validator_fn=build_validator,
        state_dict_adapter=Llama3StateDictAdapter,
    )
