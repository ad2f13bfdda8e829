"""Parallelize ``coda_llama3`` through TorchTitan's own pieces: activation checkpointing and
per-block torch.compile (``apply_ac`` / ``apply_compile``), FSDP2 and HSDP (``fully_shard``), DDP.

FSDP2 units are TorchTitan's (one per Transformer block, the token embedding, the LM head, the root)
with one difference: the final norm stays in the root unit instead of sharing the LM head's, because
the LM-head program (run by ``output``'s forward, which gathers that unit) reads its gamma directly
and the norm module's own forward never runs. The cross-block read of the next block's attention-norm gamma
is handled in the model (``model._attention_gammas``); docs/design.md "FSDP2" has the design.
Mixed precision, reshard-after-forward and gradient division follow TorchTitan's llama3 exactly.

Tensor, context and pipeline parallelism are refused with one line that says what is supported.
"""

from __future__ import annotations

import os

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_ac, apply_compile, apply_ddp
from torchtitan.tools.logging import logger

from ..kernels import EPI_C_STAGES_ENV as STAGES_ENV
from ..kernels import recompute
from . import coda_adamw, fused_clip, opt_stream

SUPPORTED = ("data_parallel_shard_degree (FSDP2), data_parallel_replicate_degree (DDP, or HSDP with sharding), "
             "activation checkpointing and compile")


def parallelize_coda(model, parallel_dims, job_config):
    unsupported = [
        (parallel_dims.tp_enabled, "tensor_parallel_degree"),
        (parallel_dims.cp_enabled, "context_parallel_degree"),
        (parallel_dims.pp_enabled, "pipeline_parallel_degree"),
    ]
    for enabled, key in unsupported:
        if enabled:
            raise ValueError(f"coda_llama3 does not support parallelism.{key} > 1; it supports {SUPPORTED}")
    model_compile = job_config.compile.enable and "model" in job_config.compile.components
    ac = job_config.activation_checkpoint
    graphs = getattr(getattr(job_config, "coda", None), "cuda_graphs", False)
    if graphs:
        _check_cuda_graphs(model_compile, job_config, parallel_dims)
    opt_stream.check(job_config, parallel_dims, model)
    fused_clip.check(job_config, parallel_dims)
    coda_adamw.check(job_config, parallel_dims)
    _stage_budget(model, getattr(job_config, "coda", None))
    # Full AC with compile: checkpoint *around* each compiled block, not compiled *through*. Compiled
    # through (TorchTitan's order), the partitioner decides per op whether to recompute, and it kept
    # the outputs of CODA's programs (custom ops): on 8B with compile, full AC recomputed nothing
    # (docs/design.md "Activation checkpointing with compile"). Around, the block keeps only its
    # inputs and reruns its compiled forward in the backward, as full AC does without compile.
    compile_first = model_compile and ac.mode == "full"
    if compile_first:  # in place (nn.Module.compile): no _orig_mod in the checkpoint FQNs under the wrapper
        for block in model.layers.children():
            block.compile(backend=job_config.compile.backend, fullgraph=True)
        logger.info("Compiling each TransformerBlock with torch.compile (inside its full activation checkpoint)")
    if ac.mode != "none":
        apply_ac(
            model,
            ac,
            model_compile_enabled=model_compile and not compile_first,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
        if ac.mode == "full" and recompute.install(model.layers):  # (no MLP F1 GEMM in the recompute)
            logger.info("Full activation checkpointing recomputes each block up to its down-projection's GEMM")
    if model_compile and graphs:  # TorchTitan's per-block compile, in the mode that replays CUDA graphs
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, fullgraph=True, mode="reduce-overhead"))
        logger.info("Compiling each TransformerBlock with torch.compile, replayed as CUDA graphs ([coda] cuda_graphs)")
    elif model_compile and not compile_first:
        apply_compile(model, job_config.compile)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        logger.info(f"Applied {'HSDP' if parallel_dims.dp_replicate_enabled else 'FSDP'} to the model")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=model_compile)
        logger.info("Applied DDP to the model")
    return model


def _stage_budget(model, coda) -> None:
    """``[coda] b2_c_stages`` > 0 asks the cute kernels for that C-stage base (``kernels/cute/stages.py``)
    through their environment variable, where the model runs them; one already set in the environment wins."""
    base = getattr(coda, "b2_c_stages", 0)
    if base and getattr(model, "backend_name", None) == "cute":
        value = os.environ.setdefault(STAGES_ENV, str(base))
        logger.info(f"B2's and the bf16 B3's epilogue C-stage base: {value}" + ("" if value == str(base) else f" ({STAGES_ENV})"))


def _check_cuda_graphs(model_compile: bool, job_config, parallel_dims) -> None:
    """``[coda] cuda_graphs`` runs where its graphs hold: compiled blocks (inductor's CUDA-graph trees),
    on one GPU, without activation checkpointing (a recomputed forward inside the backward would
    replay the forward's graph out of order). Anything else is refused with one line."""
    from .job_config import ConfigError

    why = [(not model_compile, 'compile.enable = true with "model" in compile.components'),
           (job_config.compile.backend != "inductor", f'compile.backend = "inductor" (got "{job_config.compile.backend}")'),
           (job_config.activation_checkpoint.mode != "none",
            f'activation_checkpoint.mode = "none" (got "{job_config.activation_checkpoint.mode}")'),
           (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled, "a single GPU (no FSDP2 / DDP)")]
    missing = [need for bad, need in why if bad]
    if missing:
        raise ConfigError(f"[coda] cuda_graphs = true needs {'; '.join(missing)}")


def apply_fsdp(model, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward_policy: str = "default") -> None:
    """FSDP2 units: the token embedding, every block, the LM head (``output``, whose forward runs F4)
    and the root (which keeps the final norm), forward inputs left in their dtypes. Gradient division is off, as in TorchTitan, which
    scales the loss by the global token count; on gloo (CPU) the reduce-scatter is a plain sum (gloo
    has no pre-multiplied sum)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    reshard = {"always": True, "never": False, "default": True}.get(reshard_after_forward_policy)
    if reshard is None:
        raise ValueError(f"parallelism.fsdp_reshard_after_forward must be default, always or never, "
                         f"got {reshard_after_forward_policy!r}")
    # cast_forward_inputs off: a block's inputs are mixed on purpose (the fp32 rstd, the fp64 RoPE
    # frequencies, e4m3 operands); FSDP's default would cast them all to the parameter dtype
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    config = {"mesh": dp_mesh, "mp_policy": mp}
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=reshard)
    if model.output is not None:  # as TorchTitan's [norm, output] unit; the norm (d values) stays in the root
        fully_shard(model.output, **config, reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **config)
    model.fsdp_param_dtype = param_dtype  # the dtype of FSDP's gathered parameters (the model's gamma gather)
    gloo = dp_mesh.device_type == "cpu"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)
