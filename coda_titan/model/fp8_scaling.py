"""Delayed fp8 scaling state of ``coda_llama3`` (precision = "fp8"; docs/fp8.md has the recipe).

Sites with a delayed scale, i.e. tensors a producer epilogue quantizes tile by tile before the
amax of the whole tensor exists:

* activations: per layer l, site 2l is the attention input H (F3's A operand) and site 2l + 1 the
  MLP input H (F2's). A training forward records each site's current amax; the scale is
  e4m3_max / max(history), with ``fp8_act_margin`` powers of two of headroom (default one). The
  first step has no history: it calibrates on the current amax.
* F1 inputs on an fp8 mainloop (``INPUT_SITES``): per layer, the SwiGLU output y that the
  down-projection reads as e4m3 (``fp8_down_proj``, site "down") and the attention output o that the
  out-projection reads (``fp8_out_proj``, site "out"); delayed like the activations, each amax
  recorded by its cast. Likewise F2's pre-activations a, saved as e4m3 for B3 (``fp8_preact``, site
  "preact"), with the scale rounded down to a power of two.
* MLP gradients (``fp8_mlp_dgrad`` / ``fp8_mlp_wgrad``): per layer, da as e5m2 written by B3. Its
  amax is only known in the backward; it comes back through autograd as the gradient of a
  ``GradAmaxSink`` tensor, and enters the history at the next forward. The scale keeps
  ``fp8_grad_margin`` powers of two of headroom over the history's max.
* QKV gradients (``fp8_dgrad``): per layer, F3's da as e5m2 written by B1, for B2's fp8 GEMM; the
  same recipe, its amax in a second column of the same sink.

The histories are non-persistent buffers, so the model's state dict stays stock llama3's. They reach
TorchTitan's checkpoints as a state of their own, ``coda_fp8`` (``checkpoint_state`` /
``load_checkpoint_state`` here, attached by ``titan.fp8_state``): a resumed fp8 run continues with the
histories it saved, and a checkpoint without them (stock, bf16, older) starts a fresh calibration.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.scaling import E4M3_MAX, E5M2_MAX, inv_scale_from_amax, pow2_floor


ALIGN_BYTES = 16  # inductor's input alignment (``torch._inductor.utils.ALIGNMENT``)


def aligned_unbind(t: torch.Tensor) -> list[torch.Tensor]:
    """``t.unbind(0)`` with every row at a 16-byte-aligned address (one padded copy of ``t``).

    Why: a compiled block assumes a tensor input aligned when the first call's was (layer 0's row),
    and then copies that input on every call where it is not (inductor's ``copy_misaligned_inputs``).
    Per-layer scales cut from one (n_layers,) fp32 tensor sit 4 bytes apart, so three layers in four
    paid one copy per scale and call: 8 small copies in each fp8 block's forward, about 0.3 ms of host
    time there (the CODA fp8 profile, docs/fp8.md)."""
    n, row = t.shape[0], t[0].numel() if t.shape[0] else 0
    per = ALIGN_BYTES // t.element_size()
    width = -(-max(row, 1) // per) * per
    padded = torch.nn.functional.pad(t.reshape(n, row), (0, width - row))
    return [r[:row].view(t.shape[1:]) for r in padded.unbind(0)]


# gradient site -> the name of its history (``<name>_history``) and of its row of ``saturation``: B3's da, B1's da
GRADIENT_SITES = {"mlp": "gradient", "qkv": "qkv_gradient"}


class GradAmaxSink:
    """A fresh zero tensor per forward, one 16-byte-aligned scalar per layer and gradient site
    (``GRADIENT_SITES``; ``aligned_unbind``'s alignment), that each layer's Function of that site
    takes as an input; the Function's backward returns that layer's amax |da| as its gradient.
    Works compiled too: it is an ordinary autograd edge."""

    def __init__(self, n_layers: int, device):
        col = ALIGN_BYTES // 4
        self.tensor = torch.zeros(n_layers, col * len(GRADIENT_SITES), device=device, dtype=torch.float32,
                                  requires_grad=True)
        with torch.enable_grad():
            rows = self.tensor.unbind(0)
            self.per_layer = {site: [row[col * k] for row in rows] for k, site in enumerate(GRADIENT_SITES)}

    def amaxes(self, site: str = "mlp") -> torch.Tensor | None:
        """The (n_layers,) amaxes of ``site`` the last backward left, or None if no backward ran."""
        col = ALIGN_BYTES // 4 * list(GRADIENT_SITES).index(site)
        return None if self.tensor.grad is None else self.tensor.grad[:, col]


# Activations a producer writes as e4m3 with a delayed scale of its own: the F1 inputs on an fp8 mainloop (W2's y,
# W_o's o), and F2's pre-activations a, saved for B3 (``fp8_preact``), whose scale is a power of two (``POW2_SITES``)
INPUT_SITES = ("down", "out", "preact")
POW2_SITES = ("preact",)  # (B3 decodes a = code * 2^-k exactly: the very values a bf16 a of the codes holds)
SATURATION_KINDS = ("activation", *INPUT_SITES, *GRADIENT_SITES.values())  # the rows of ``Fp8Scaling.saturation``


class Fp8Scaling(nn.Module):
    """Amax histories (newest first) and the scales they give."""

    def __init__(self, n_layers: int, history: int, grad_margin: int, act_margin: int = 0):
        super().__init__()
        self.grad_margin, self.act_margin = grad_margin, act_margin
        self.register_buffer("activation_history", torch.zeros(2 * n_layers, history), persistent=False)
        self.register_buffer("gradient_history", torch.zeros(n_layers, history), persistent=False)
        self.register_buffer("qkv_gradient_history", torch.zeros(n_layers, history), persistent=False)
        for site in INPUT_SITES:
            self.register_buffer(f"{site}_history", torch.zeros(n_layers, history), persistent=False)
        # per kind of site: how many site-steps a delayed scale clamped (the step's amax beyond the
        # range its history gave), and the largest amax / range seen; on the device, read once at the end
        self.register_buffer("saturation", torch.zeros(len(SATURATION_KINDS), 2), persistent=False)
        self.reset()

    @property
    def act_headroom(self) -> float:
        """What an activation or F1-input scale covers beyond its history's max: 2**fp8_act_margin."""
        return 2.0**self.act_margin

    @property
    def grad_headroom(self) -> float:
        """The same for a gradient scale: 2**fp8_grad_margin (a step's amax may outgrow the history)."""
        return 2.0**self.grad_margin

    def reset(self, device=None) -> None:
        """Forget every history (``init_weights``)."""
        if device is not None:
            self.activation_history = torch.zeros_like(self.activation_history, device=device)
            for name in GRADIENT_SITES.values():
                setattr(self, f"{name}_history", torch.zeros_like(getattr(self, f"{name}_history"), device=device))
            for site in INPUT_SITES:
                setattr(self, f"{site}_history", torch.zeros_like(self.input_history(site), device=device))
            self.saturation = torch.zeros_like(self.saturation, device=device)
        else:
            self.activation_history.zero_()
            for site in GRADIENT_SITES:
                self._gradient_history(site).zero_()
            for site in INPUT_SITES:
                self.input_history(site).zero_()
            self.saturation.zero_()
        self.activations_calibrated = False
        for site in GRADIENT_SITES:
            setattr(self, _calibrated_attr(site), False)
        self.input_calibrated = {site: False for site in INPUT_SITES}
        self.sink: GradAmaxSink | None = None
        self.sink_sites: tuple[str, ...] = ()  # the gradient sites the sink's forward took

    def flush_sink(self) -> None:
        """Move the amaxes the last backward left into the gradient history now (what the next
        forward would do first), so the history alone is the whole state."""
        if self.sink is not None and self.sink.amaxes() is not None:
            with torch.no_grad():
                for site in self.sink_sites:
                    history = self._gradient_history(site)
                    new = self.sink.amaxes(site).to(history)
                    if self._calibrated(site):
                        self._count_saturation(GRADIENT_SITES[site], history, new, self.grad_headroom)
                    _push(history, new)
                    setattr(self, _calibrated_attr(site), True)
        self.sink, self.sink_sites = None, ()

    def _calibrated(self, site: str) -> bool:
        return getattr(self, _calibrated_attr(site))

    def _gradient_history(self, site: str) -> torch.Tensor:
        return getattr(self, f"{GRADIENT_SITES[site]}_history")

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: both histories and whether each is calibrated."""
        self.flush_sink()
        flags = torch.tensor([self.activations_calibrated, self.gradients_calibrated], dtype=torch.int8)
        state = {"activation_history": self.activation_history, "gradient_history": self.gradient_history,
                 "calibrated": flags}
        for site in INPUT_SITES:
            state[f"{site}_history"] = self.input_history(site)
            state[f"{site}_calibrated"] = torch.tensor([self.input_calibrated[site]], dtype=torch.int8)
        state["qkv_gradient_history"] = self.qkv_gradient_history
        state["qkv_gradient_calibrated"] = torch.tensor([self.qkv_gradients_calibrated], dtype=torch.int8)
        return state

    def load_checkpoint_state(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.activation_history.copy_(state_dict["activation_history"])
        self.gradient_history.copy_(state_dict["gradient_history"])
        self.activations_calibrated, self.gradients_calibrated = (bool(v) for v in state_dict["calibrated"].tolist())
        for site in INPUT_SITES:  # (a checkpoint older than a site has none of it: that site calibrates)
            if f"{site}_history" in state_dict:
                self.input_history(site).copy_(state_dict[f"{site}_history"])
                self.input_calibrated[site] = bool(state_dict[f"{site}_calibrated"].item())
            else:
                self.input_history(site).zero_()
                self.input_calibrated[site] = False
        self.qkv_gradients_calibrated = "qkv_gradient_history" in state_dict and bool(
            state_dict["qkv_gradient_calibrated"].item())
        # (likewise the QKV gradient site; the checkpointer may have loaded into this very tensor, which
        # ``checkpoint_state`` handed it: zeroed only where it is not restored)
        if self.qkv_gradients_calibrated:
            self.qkv_gradient_history.copy_(state_dict["qkv_gradient_history"])
        else:
            self.qkv_gradient_history.zero_()
        self.sink, self.sink_sites = None, ()

    def _memo(self, name: str, history: torch.Tensor, calibrated: bool, make):
        """``make()``, kept while ``history`` is the same tensor at the same version (every update of a
        history is in place, or replaces it) and its calibration flag is unchanged: the scales are pure
        functions of it, so ``prepare`` can take them before the forward that reads them."""
        key = (id(history), history._version, calibrated)
        memo = self.__dict__.setdefault("_memos", {})
        if memo.get(name, (None,))[0] != key:
            memo[name] = (key, make())
        return memo[name][1]

    def prepare(self, sites: list[str]) -> None:
        """Take every scale the next forward reads now (the optimizer step's post-hook: the host is
        ahead of the GPU there, not at the next step's start): the last backward's gradient amaxes
        moved into their history, then the activation, F1-input (``sites``) and gradient scales."""
        self.flush_sink()
        self.activation_inv_scales()
        for site in sites:
            self.input_inv_scales(site)
        self._gradient_inv_scales()
        self._gradient_inv_scales("qkv")

    def activation_inv_scales(self) -> list[torch.Tensor | None]:
        """Per-site inverse scales 448 / max(history), or all None on the calibration step."""
        if not self.activations_calibrated:
            return [None] * self.activation_history.shape[0]
        h = self.activation_history
        return self._memo("activation", h, True,
                          lambda: aligned_unbind(inv_scale_from_amax(h.amax(-1) * self.act_headroom)))

    def input_history(self, site: str) -> torch.Tensor:
        return getattr(self, f"{site}_history")

    def input_inv_scales(self, site: str) -> list[torch.Tensor | None]:
        """Per-layer inverse scales of an F1 input site (``INPUT_SITES``), or all None to calibrate."""
        if not self.input_calibrated[site]:
            return [None] * self.input_history(site).shape[0]
        h = self.input_history(site)
        return self._memo(site, h, True, lambda: aligned_unbind(_site_inv(site, h.amax(-1) * self.act_headroom)))

    @torch.no_grad()
    def record_input(self, site: str, amaxes: list[torch.Tensor]) -> None:
        history = self.input_history(site)
        new = torch.stack([a.to(history.dtype) for a in amaxes])
        if self.input_calibrated[site]:
            self._count_saturation(site, history, new, self.act_headroom)
        _push(history, new)
        self.input_calibrated[site] = True

    @torch.no_grad()
    def record_activations(self, amaxes: list[torch.Tensor]) -> None:
        new = torch.stack([a.to(self.activation_history.dtype) for a in amaxes])
        if self.activations_calibrated:
            self._count_saturation("activation", self.activation_history, new, self.act_headroom)
        _push(self.activation_history, new)
        self.activations_calibrated = True

    def _count_saturation(self, kind: str, history: torch.Tensor, new: torch.Tensor, headroom: float) -> None:
        """Before ``new`` (this step's amax per site) enters ``history``: the sites whose cast clamped,
        i.e. whose amax passed what the scale this step used covers (history max x ``headroom``; for a
        ``POW2_SITES`` kind, what that scale rounded down to a power of two covers, up to twice as much)."""
        covered = (history.amax(-1) * headroom).clamp_min(torch.finfo(torch.float32).tiny)
        if kind in POW2_SITES:
            covered = E4M3_MAX / _site_inv(kind, covered)
        ratio = new / covered
        row = self.saturation[SATURATION_KINDS.index(kind)]
        row[0] += (ratio > 1).sum()
        row[1] = torch.maximum(row[1], ratio.max())

    def saturation_report(self) -> str | None:
        """One line on the delayed scales' clamps since the start (None when no cast clamped)."""
        parts = [f"{kind} {int(n)} (amax up to {worst:.2f}x the scale's range)"
                 for kind, (n, worst) in zip(SATURATION_KINDS, self.saturation.tolist()) if n]
        if not parts:
            return None
        return ("fp8 delayed scales clamped at site-steps: " + ", ".join(parts)
                + "; the values beyond the range saturated at the format's largest (docs/fp8.md)")

    def gradient_sites(self, device, mlp: bool, qkv: bool = False) -> dict[str, tuple[list, list]]:
        """Per gradient site (``GRADIENT_SITES``): (per-layer delayed inverse e5m2 scales, or Nones to
        calibrate; per-layer sink tensors), both all None where the site is off (``mlp``, ``qkv``).
        First moves the amaxes the last backward left in the previous sink into the histories."""
        n = self.gradient_history.shape[0]
        self.flush_sink()
        on = {site: flag for site, flag in zip(GRADIENT_SITES, (mlp, qkv))}
        if any(on.values()):
            self.sink, self.sink_sites = GradAmaxSink(n, device), tuple(site for site, f in on.items() if f)
        return {site: (self._gradient_inv_scales(site), self.sink.per_layer[site]) if f else ([None] * n, [None] * n)
                for site, f in on.items()}

    def _gradient_inv_scales(self, site: str = "mlp") -> list[torch.Tensor | None]:
        h = self._gradient_history(site)
        if not self._calibrated(site):
            return [None] * h.shape[0]
        return self._memo(f"gradient_{site}", h, True,
                          lambda: aligned_unbind(inv_scale_from_amax(h.amax(-1) * self.grad_headroom, E5M2_MAX)))


def _site_inv(site: str, amax: torch.Tensor) -> torch.Tensor:
    """An input site's inverse e4m3 scale for ``amax`` (history max x headroom): 448 / amax, rounded down to a
    power of two for ``POW2_SITES``. The scale the forward uses and the range its clamp count judges by."""
    inv = inv_scale_from_amax(amax)
    return pow2_floor(inv) if site in POW2_SITES else inv


def _calibrated_attr(site: str) -> str:
    """The flag of a gradient site's history (``gradients_calibrated``, ``qkv_gradients_calibrated``)."""
    return f"{GRADIENT_SITES[site]}s_calibrated"


def _push(history: torch.Tensor, new: torch.Tensor) -> None:
    """Shift ``history`` (sites, steps) by one step and put ``new`` (sites,) first."""
    history.copy_(torch.cat([new[:, None], history[:, :-1]], dim=1))
