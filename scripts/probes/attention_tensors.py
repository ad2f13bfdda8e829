"""The bf16 step probe's activation recorder (``bf16_step_accuracy --tensors``): where in a layer a model's
step leaves the fp32 step's values.

At trained states CODA's bf16 gradients of wq, wk, wv and attention_norm are further from fp32 than stock's,
while its MLP and wo gradients are not (the one-step probe's per-kind tables). Those four gradients share
two factors, the attention's input gradients (dq, dk, dv) and the QKV GEMM's input; wo's gradient reads the
attention's output and the residual gradient. So the recorder reads, in every layer, at the two boundaries
every model has alike:

* the block's input, the residual stream ``x``, and its gradient ``dx`` (the block's forward pre-hook);
* the attention module's inputs ``q``, ``k``, ``v`` (post-RoPE, (b, h, s, d)), its output ``o``, and their
  gradients ``dq``, ``dk``, ``dv``, ``do`` (a forward hook on ``attention.inner_attention``);
* ``dx_sum`` and ``do_sum``: dx and do summed over the tokens.

The reference model ("fp32", built first) keeps its tensors (fp32, on its device); every later model's are
compared to them as they arrive, ||t - t_fp32|| / ||t_fp32||, and only the numbers are kept. The cute
backend's packed FA4 path calls its kernels, not the module, so ``coda_eager`` records only ``x`` and ``dx``;
``coda_eager_fa4_unpacked`` and ``torch_eager`` call the module. Under the reference's activation checkpointing
the hooks fire again in the recomputation, on equal values (the later write replaces the first).
"""

from __future__ import annotations

import functools
import statistics

import torch

KEYS = ("x", "q", "k", "v", "o", "dx", "dq", "dk", "dv", "do", "dx_sum", "do_sum")
# (dx_sum, do_sum: the gradients summed over the tokens, the part of their error every token shares, which a
# sum over tokens such as dv = P^T dO does not average away)


class Recorder:
    """``attach(name, model)`` is ``bf16_step_accuracy.measure``'s ``instrument``; ``rows[name][layer][key]``:
    the relative error of that tensor against the reference's."""

    def __init__(self, reference: str = "fp32"):
        self.reference, self.name = reference, None
        self.ref: dict[tuple[int, str], torch.Tensor] = {}
        self.rows: dict[str, dict[int, dict[str, float]]] = {}
        self._handles: list = []

    def attach(self, name: str, model: torch.nn.Module) -> None:
        for h in self._handles:  # (the previous model's hooks: it is freed, but not necessarily yet)
            h.remove()
        self._handles, self.name = [], name
        if name != self.reference:
            self.rows[name] = {}
        for i, block in enumerate(model.layers.values()):
            block = getattr(block, "_checkpoint_wrapped_module", block)
            block = getattr(block, "_orig_mod", block)
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._block, i), with_kwargs=True))
            self._handles.append(block.attention.inner_attention.register_forward_hook(functools.partial(self._attn, i)))

    def _block(self, i, module, args, kwargs):
        self._value(i, "x", args[0] if args else kwargs["x"])

    def _attn(self, i, module, args, out):
        for key, t in zip(("q", "k", "v"), args[:3]):
            self._value(i, key, t)
        self._value(i, "o", out)

    def _value(self, i: int, key: str, t: torch.Tensor) -> None:
        self._record(i, key, t)
        if t.requires_grad:
            t.register_hook(functools.partial(self._grad, i, "d" + key))

    def _grad(self, i: int, key: str, g: torch.Tensor) -> None:
        self._record(i, key, g)
        if key == "dx":
            self._record(i, "dx_sum", g.reshape(-1, g.shape[-1]).sum(0))
        elif key == "do":
            self._record(i, "do_sum", g.sum(2))

    def _record(self, i: int, key: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if self.name == self.reference:
                self.ref[(i, key)] = t.detach().float().clone()
                return
            r = self.ref.get((i, key))
            if r is None or r.numel() != t.numel():
                raise AssertionError(f"{self.name}: layer {i} {key} {tuple(t.shape)} has no reference of its size "
                                     f"({None if r is None else tuple(r.shape)})")
            # (stock's residual stream is (b, s, d), CODA's (b * s, d) in the same order: compared as the reference's)
            d = (t.reshape(r.shape).double() - r.double()).norm().item()
            self.rows[self.name].setdefault(i, {})[key] = d / max(r.double().norm().item(), 1e-300)

    def summary(self) -> dict:
        """Per model and key: the median over layers, the largest and its layer."""
        out = {}
        for name, layers in self.rows.items():
            per = {}
            for key in KEYS:
                vals = {i: row[key] for i, row in layers.items() if key in row}
                if vals:
                    worst = max(vals, key=vals.get)
                    per[key] = {"median": statistics.median(vals.values()), "max": vals[worst], "max_layer": worst}
            out[name] = per
        return out

    def table(self) -> str:
        """Per layer, each key's error, one model after the other (the log's view)."""
        lines = []
        for name, layers in self.rows.items():
            lines.append(f"{name}: " + " ".join(f"{k:>8}" for k in KEYS))
            for i in sorted(layers):
                lines.append(f"  layer {i:2d}  " + " ".join(
                    f"{layers[i][k]:8.2e}" if k in layers[i] else f"{'-':>8}" for k in KEYS))
        return "\n".join(lines)
