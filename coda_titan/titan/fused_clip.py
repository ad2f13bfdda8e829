"""``[coda] fused_clip``: the gradient clipping's scale applied inside the fused AdamW step.

TorchTitan clips with ``torch.nn.utils``: one foreach pass for the total norm, then a foreach multiply
that reads and writes every gradient by ``min(max_norm / (norm + 1e-6), 1)``, and then the fused AdamW
step reads every gradient again. torch's fused Adam/AdamW take a ``grad_scale`` that divides each
gradient as the step loads it (the AMP unscale), and write the divided gradient back. With the knob on,
the clip computes the norm and the coefficient exactly as TorchTitan's does, and hands
``1 / coefficient`` (fp32) to each optimizer as its ``grad_scale`` for this step instead of the
multiply pass: one read and one write of every gradient less. After the step each ``.grad`` holds the
clipped gradient, as before, and the logged gradient norm is the same norm.

Numerics: where the coefficient is 1 (the norm is under ``max_norm``) the step is the same bit for bit.
Where it clips, the step uses g / (1 / c) in fp32, where TorchTitan's used g * c rounded to the
gradient's dtype (bf16): at most a rounding of the clipped gradient apart (tests/test_fused_clip.py).

How: TorchTitan's trainer calls ``torchtitan.distributed.utils.clip_grad_norm_`` by attribute, each
step, right before ``optimizers.step()``; ``install`` wraps that function once. The wrapper takes the
fused path only for the parameters of a container installed here, on one device, without pipeline
or expert parallelism; any other call goes to TorchTitan's function unchanged.
"""

from __future__ import annotations

import torch

_ACTIVE: FusedClip | None = None
_ORIGINAL = None


class FusedClip:
    """The clip of one ``OptimizersContainer``'s parameters, folded into its steps (``install``)."""

    def __init__(self, optimizers, params: list[torch.nn.Parameter]):
        self.optimizers = list(getattr(optimizers, "optimizers", [optimizers]))
        self.ids = frozenset(id(p) for p in params)
        self.scale: torch.Tensor | None = None  # this step's divisor, from the clip
        self.held: torch.Tensor | None = None  # the last step's, alive until the next clip (a side stream may read it)
        self.said = False

    def covers(self, params: list[torch.Tensor]) -> bool:
        return len(params) == len(self.ids) and all(id(p) in self.ids for p in params)

    def clip(self, params, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach) -> torch.Tensor:
        """TorchTitan's total norm and torch's clip coefficient, kept as the step's ``grad_scale``."""
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # (torch.nn.utils.clip_grads_with_norm_)
        self.scale = coef.to(torch.float32).reciprocal()
        if not self.said:
            from torchtitan.tools.logging import logger

            self.said = True
            logger.info("coda_titan: [coda] fused_clip: the gradient clip's scale is applied inside the fused AdamW step")
        return total

    def before_step(self, *_) -> None:
        if self.scale is not None:
            for opt in self.optimizers:
                opt.grad_scale = self.scale

    def after_step(self, *_) -> None:
        for opt in self.optimizers:
            opt.__dict__.pop("grad_scale", None)  # (a step without this step's clip must not reuse it)
        self.held, self.scale = self.scale, None


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None,
                    ep_enabled=False):
    """TorchTitan's ``clip_grad_norm_``, with the fused path for an installed container's parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    active = _ACTIVE
    if active is not None and pp_mesh is None and not ep_enabled and active.covers(params):
        return active.clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return _ORIGINAL(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)


def install(optimizers, model_parts: list[torch.nn.Module]) -> FusedClip:
    """Fold the clip of ``model_parts``' gradients into ``optimizers``' fused steps (one container per
    process: the last installed is the one the wrapper serves)."""
    global _ACTIVE, _ORIGINAL
    from torchtitan.distributed import utils as dist_utils

    for opt in getattr(optimizers, "optimizers", [optimizers]):
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW) or not all(g.get("fused") for g in opt.param_groups):
            raise ValueError(f"[coda] fused_clip needs fused Adam / AdamW optimizers, got {type(opt).__name__}")
    if _ORIGINAL is None:
        _ORIGINAL = dist_utils.clip_grad_norm_
        dist_utils.clip_grad_norm_ = clip_grad_norm_
    _ACTIVE = FusedClip(optimizers, [p for m in model_parts for p in m.parameters()])
    optimizers.register_step_pre_hook(_ACTIVE.before_step)
    optimizers.register_step_post_hook(_ACTIVE.after_step)
    return _ACTIVE


def check(job_config, parallel_dims) -> None:
    """``[coda] fused_clip`` needs one device (no FSDP2 / DDP / PP / EP) and a fused Adam or AdamW
    stepped after the backward; anything else is refused with one line."""
    check_fused_adam_knob(job_config, parallel_dims, "fused_clip", ("Adam", "AdamW"))


def check_fused_adam_knob(job_config, parallel_dims, knob: str, names: tuple[str, ...]) -> None:
    """A ``[coda]`` optimizer knob (``fused_clip``, ``coda_adamw``), when on, needs one device and TorchTitan's
    fused optimizer of one of ``names`` stepped after the backward: a ConfigError naming what is missing."""
    from .job_config import ConfigError

    if not getattr(getattr(job_config, "coda", None), knob, False):
        return
    opt = job_config.optimizer
    name = " (or ".join(f'"{n}"' for n in reversed(names)) + ")" * (len(names) - 1)
    why = [(parallel_dims.world_size > 1, "a single device (no FSDP2 / DDP / PP / EP)"),
           (opt.name not in names, f"optimizer.name = {name}"),
           (opt.implementation != "fused", 'optimizer.implementation = "fused"'),
           (opt.early_step_in_backward, "optimizer.early_step_in_backward = false")]
    missing = [need for bad, need in why if bad]
    if missing:
        raise ConfigError(f"[coda] {knob} = true needs {'; '.join(missing)} (or turn it off: --coda.no_{knob})")
