"""Parallelize ``coda_llama3`` for one device: activation checkpointing and per-layer torch.compile
(TorchTitan's own ``apply_ac`` / ``apply_compile``, which walk ``model.layers``), plus DDP.

Tensor, context, pipeline and sharded data parallelism are not supported yet and are refused with
a clear error instead of training something silently different.
"""

from __future__ import annotations

from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_ac, apply_compile, apply_ddp
from torchtitan.tools.logging import logger


def parallelize_coda(model, parallel_dims, job_config):
    unsupported = [
        (parallel_dims.tp_enabled, "tensor_parallel_degree"),
        (parallel_dims.cp_enabled, "context_parallel_degree"),
        (parallel_dims.pp_enabled, "pipeline_parallel_degree"),
        (parallel_dims.fsdp_enabled, "data_parallel_shard_degree"),
    ]
    for enabled, key in unsupported:
        if enabled:
            raise ValueError(
                f"coda_llama3 does not support parallelism.{key} > 1 yet; "
                "use data_parallel_replicate_degree (DDP) or one device"
            )
    model_compile = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=model_compile,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if model_compile:
        apply_compile(model, job_config.compile)
    if parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=model_compile)
        logger.info("Applied DDP to the model")
    return model
