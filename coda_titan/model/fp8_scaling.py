"""Delayed fp8 scaling state of ``coda_llama3`` (precision = "fp8"; docs/fp8.md has the recipe).

Sites with a delayed scale, i.e. tensors a producer epilogue quantizes tile by tile before the
amax of the whole tensor exists:

* activations: per layer l, site 2l is the attention input H (F3's A operand) and site 2l + 1 the
  MLP input H (F2's). A training forward records each site's current amax; the scale is
  e4m3_max / max(history). The first step has no history: it calibrates on the current amax.
* down-projection inputs (``fp8_down_proj``): per layer, the SwiGLU output y that the down-projection
  (F1 on an fp8 mainloop) reads as e4m3; delayed like the activations, its amax recorded by the cast.
* MLP gradients (``fp8_mlp_dgrad`` / ``fp8_mlp_wgrad``): per layer, da as e5m2 written by B3. Its
  amax is only known in the backward; it comes back through autograd as the gradient of a
  ``GradAmaxSink`` tensor, and enters the history at the next forward. The scale keeps
  ``fp8_grad_margin`` powers of two of headroom over the history's max.

The histories are non-persistent buffers, so the model's state dict stays stock llama3's. They reach
TorchTitan's checkpoints as a state of their own, ``coda_fp8`` (``checkpoint_state`` /
``load_checkpoint_state`` here, attached by ``titan.fp8_state``): a resumed fp8 run continues with the
histories it saved, and a checkpoint without them (stock, bf16, older) starts a fresh calibration.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.scaling import E5M2_MAX, inv_scale_from_amax


class GradAmaxSink:
    """A fresh (n_layers,) zero tensor per forward that each layer's MLP Function takes as an input;
    the Function's backward returns that layer's amax |da| as its gradient. Works compiled too: it
    is an ordinary autograd edge."""

    def __init__(self, n_layers: int, device):
        self.tensor = torch.zeros(n_layers, device=device, dtype=torch.float32, requires_grad=True)
        with torch.enable_grad():
            self.per_layer = list(self.tensor.unbind(0))

    def amaxes(self) -> torch.Tensor | None:
        """The amaxes the last backward left, or None if no backward ran."""
        return self.tensor.grad


class Fp8Scaling(nn.Module):
    """Amax histories (newest first) and the scales they give."""

    def __init__(self, n_layers: int, history: int, grad_margin: int):
        super().__init__()
        self.grad_margin = grad_margin
        self.register_buffer("activation_history", torch.zeros(2 * n_layers, history), persistent=False)
        self.register_buffer("gradient_history", torch.zeros(n_layers, history), persistent=False)
        self.register_buffer("down_history", torch.zeros(n_layers, history), persistent=False)
        self.reset()

    def reset(self, device=None) -> None:
        """Forget every history (``init_weights``)."""
        if device is not None:
            self.activation_history = torch.zeros_like(self.activation_history, device=device)
            self.gradient_history = torch.zeros_like(self.gradient_history, device=device)
            self.down_history = torch.zeros_like(self.down_history, device=device)
        else:
            self.activation_history.zero_()
            self.gradient_history.zero_()
            self.down_history.zero_()
        self.activations_calibrated = False
        self.gradients_calibrated = False
        self.down_calibrated = False
        self.sink: GradAmaxSink | None = None

    def flush_sink(self) -> None:
        """Move the amaxes the last backward left into the gradient history now (what the next
        forward would do first), so the history alone is the whole state."""
        if self.sink is not None and self.sink.amaxes() is not None:
            with torch.no_grad():
                _push(self.gradient_history, self.sink.amaxes().to(self.gradient_history))
            self.gradients_calibrated = True
        self.sink = None

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: both histories and whether each is calibrated."""
        self.flush_sink()
        flags = torch.tensor([self.activations_calibrated, self.gradients_calibrated], dtype=torch.int8)
        return {"activation_history": self.activation_history, "gradient_history": self.gradient_history,
                "calibrated": flags, "down_history": self.down_history,
                "down_calibrated": torch.tensor([self.down_calibrated], dtype=torch.int8)}

    def load_checkpoint_state(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.activation_history.copy_(state_dict["activation_history"])
        self.gradient_history.copy_(state_dict["gradient_history"])
        self.activations_calibrated, self.gradients_calibrated = (bool(v) for v in state_dict["calibrated"].tolist())
        if "down_history" in state_dict:  # (a checkpoint older than fp8_down_proj has none: it calibrates)
            self.down_history.copy_(state_dict["down_history"])
            self.down_calibrated = bool(state_dict["down_calibrated"].item())
        else:
            self.down_history.zero_()
            self.down_calibrated = False
        self.sink = None

    def activation_inv_scales(self) -> list[torch.Tensor | None]:
        """Per-site inverse scales 448 / max(history), or all None on the calibration step."""
        if not self.activations_calibrated:
            return [None] * self.activation_history.shape[0]
        return list(inv_scale_from_amax(self.activation_history.amax(-1)).unbind(0))

    def down_inv_scales(self) -> list[torch.Tensor | None]:
        """Per-layer inverse scales of the down-projection input y, or all None to calibrate."""
        if not self.down_calibrated:
            return [None] * self.down_history.shape[0]
        return list(inv_scale_from_amax(self.down_history.amax(-1)).unbind(0))

    @torch.no_grad()
    def record_down(self, amaxes: list[torch.Tensor]) -> None:
        _push(self.down_history, torch.stack([a.to(self.down_history.dtype) for a in amaxes]))
        self.down_calibrated = True

    @torch.no_grad()
    def record_activations(self, amaxes: list[torch.Tensor]) -> None:
        _push(self.activation_history, torch.stack([a.to(self.activation_history.dtype) for a in amaxes]))
        self.activations_calibrated = True

    def gradient_sites(self, device, enabled: bool) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(per-layer delayed inverse e5m2 scales, or Nones to calibrate; per-layer sink tensors, or
        Nones when ``enabled`` is False). First moves the amaxes the last backward left in the
        previous sink into the history."""
        n = self.gradient_history.shape[0]
        self.flush_sink()
        if not enabled:
            return [None] * n, [None] * n
        inv: list[torch.Tensor | None] = [None] * n
        if self.gradients_calibrated:
            headroom = 2.0**self.grad_margin  # (a step's amax may outgrow the history)
            inv = list(inv_scale_from_amax(self.gradient_history.amax(-1) * headroom, E5M2_MAX).unbind(0))
        self.sink = GradAmaxSink(n, device)
        return inv, self.sink.per_layer


def _push(history: torch.Tensor, new: torch.Tensor) -> None:
    """Shift ``history`` (sites, steps) by one step and put ``new`` (sites,) first."""
    history.copy_(torch.cat([new[:, None], history[:, :-1]], dim=1))
