"""``[coda] coda_adamw``: torch's fused AdamW step, one Triton launch per step (``kernels/adamw.py``).

torch's fused AdamW runs at under two thirds of the memory's speed on the 1B model's 1.5 B bf16 parameters
(its kernel's loads are 8 bytes wide, and it launches once per 320 chunks of 65,536 elements); the kernel
here loads 16 bytes a thread and covers a whole step (or a ``step_chunk_layers`` chunk) in one launch. The
arithmetic is torch's fused functor's, in the same fp32 order; the GPU test asks for its bits. Alone it steps the
1B model in 8.28 ms against 10.92; in the 1B configs, whose step runs on a side stream under the next forward, it
measured level (docs/fp8.md), so it is off by default.

The optimizer stays a ``torch.optim.AdamW`` (``install`` swaps the instance's class for ``CodaAdamW``, a
subclass with its own ``step``): the same parameter groups, the same state (``step`` a 0-dim fp32 tensor on
the parameter's device, as torch's fused path keeps it, ``exp_avg``, ``exp_avg_sq``), the same
``state_dict``, so checkpoints move between this and stock TorchTitan either way. ``grad_scale`` (set by
``[coda] fused_clip``) divides each gradient as it is read and the divided gradient is written back, as
torch's. Tensors the kernel does not take (``kernels.adamw.supported``: off CUDA, not contiguous, not 16-byte
aligned, an element count not a multiple of 8) and steps with a ``found_inf`` (AMP) go through
``torch._fused_adamw_``, torch's own kernel, with a log line the first time.
"""

from __future__ import annotations

import torch

from ..kernels import adamw as kernel


class CodaAdamW(torch.optim.AdamW):
    """torch's AdamW (fused), stepped by ``kernels.adamw``."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("[coda] coda_adamw: an optimizer step with a closure is not supported")
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        tables = self.__dict__.setdefault("_coda_tables", kernel.Tables())
        for group in self.param_groups:
            ours, theirs = ([], [], [], [], []), ([], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:  # (torch's fused AdamW's initial state)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                row = (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
                why = "a step with found_inf" if found_inf is not None else self._unsupported(row)
                for lst, t in zip(ours if why is None else theirs, row):
                    lst.append(t)
                if why is not None:
                    self._say(why)
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])
            kernel.adamw_step(*ours, grad_scale=grad_scale, tables=tables, block=kernel.BLOCK, warps=kernel.WARPS,
                              **hyper)
            if theirs[0]:
                torch._foreach_add_(theirs[4], 1)
                torch._fused_adamw_(*theirs[:4], [], theirs[4], amsgrad=False, maximize=False, grad_scale=grad_scale,
                                    found_inf=found_inf, **hyper)
                if found_inf is not None:
                    torch._foreach_sub_(theirs[4], [found_inf] * len(theirs[4]))
        return None

    def _unsupported(self, row: tuple) -> str | None:
        """``kernels.adamw.supported`` of a row (p, g, m, v, step), its parameter-and-state half kept while the state
        tensors stay the same objects (the host's time a step: the gradient's half only)."""
        p, g, m, v, step = row
        known = self.__dict__.setdefault("_coda_state_checks", {})
        hit = known.get(id(p))
        if hit is None or hit[0] is not p or hit[1] is not m or hit[2] is not v or hit[3] is not step:
            hit = known[id(p)] = (p, m, v, step, kernel.state_unsupported(p, m, v, step))
        return hit[4] or kernel.grad_unsupported(p, g)

    def _say(self, why: str) -> None:
        if self.__dict__.get("_coda_said"):
            return
        self.__dict__["_coda_said"] = True
        from torchtitan.tools.logging import logger

        logger.warning(f"coda_titan: [coda] coda_adamw: {why}: those tensors step through torch's fused AdamW")


def eligible(opt) -> str | None:
    """Why ``opt`` cannot step through the kernel (None: it can): a fused AdamW on float learning rates."""
    if type(opt) not in (torch.optim.AdamW, CodaAdamW):
        return f"a torch.optim.AdamW, got {type(opt).__name__}"
    for g in opt.param_groups:
        bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if g.get(k)]
        if bad or not g.get("fused") or not g.get("decoupled_weight_decay", True):
            return f"fused AdamW without {', '.join(bad) or 'foreach / for-loop steps'}"
        if isinstance(g["lr"], torch.Tensor):
            return "a float learning rate (not a tensor)"
    return None


def install(optimizers) -> None:
    """Step every optimizer of a TorchTitan ``OptimizersContainer`` (or one optimizer) through the kernel."""
    for opt in getattr(optimizers, "optimizers", [optimizers]):
        why = eligible(opt)
        if why is not None:
            raise ValueError(f"[coda] coda_adamw needs {why}")
        if type(opt) is not CodaAdamW:
            opt.__class__ = CodaAdamW
            opt._patch_step_function()  # (the class's step wrapped with the optimizer hooks, as torch does at init)


def check(job_config, parallel_dims) -> None:
    """``[coda] coda_adamw`` needs one device and TorchTitan's fused AdamW; anything else is refused in one line."""
    from .fused_clip import check_fused_adam_knob

    check_fused_adam_knob(job_config, parallel_dims, "coda_adamw", ("AdamW",))
