"""The fp8 amax histories in TorchTitan's checkpoints, as a state of their own (``coda_fp8``).

The histories are not model parameters: in the model's state dict they would make every stock or
bf16 checkpoint unloadable into an fp8 model (DCP refuses a missing key). So they travel beside it:
after TorchTitan's ``CheckpointManager.load`` has run, the histories are read from the step it
loaded if that step has them (a run of ours resumed), and from then on every save writes them.
A checkpoint without them starts a fresh calibration, as before; stock llama3 ignores them.
Under data parallelism each rank's histories are its own (the amaxes of its own batches), so each rank
saves its own under ``coda_fp8.rank<r>`` (as TorchTitan keys its data loaders), and a resume on the
same number of ranks continues bit for bit. A resume on another number of ranks recalibrates (and
says so); a one-process checkpoint's histories are loaded by every rank.
"""

from __future__ import annotations

import os

from torchtitan.tools.logging import logger

KEY = "coda_fp8"


class Fp8ScalingState:
    """``Stateful`` view of a model's ``Fp8Scaling`` for DCP."""

    def __init__(self, scaling):
        self.scaling = scaling

    def state_dict(self):
        world, rank = _world_rank()
        state = self.scaling.checkpoint_state()
        return {f"rank{rank}": state} if world > 1 else state

    def load_state_dict(self, state_dict) -> None:
        world, rank = _world_rank()
        self.scaling.load_checkpoint_state(state_dict[f"rank{rank}"] if f"rank{rank}" in state_dict else state_dict)


def _world_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def saved_layout(keys) -> tuple[str, int] | None:
    """How a checkpoint's keys hold the histories: ("ranks", number of ranks that saved them),
    ("one", 1) for one copy (a one-process run, or an older sharded one), or None."""
    ours = [k[len(KEY) + 1:] for k in keys if k.startswith(KEY + ".")]
    ranks = {k.split(".", 1)[0] for k in ours if k.startswith("rank")}
    if ranks:
        return "ranks", len(ranks)
    return ("one", 1) if ours else None


def attach(trainer) -> bool:
    """Make ``trainer``'s checkpoints carry the fp8 histories of its CODA fp8 model; False (and
    nothing changed) for any other model or with checkpointing off."""
    ck = trainer.checkpointer
    model = trainer.model_parts[0] if len(trainer.model_parts) == 1 else None
    scaling = getattr(model, "fp8_scaling", None)
    coda = getattr(getattr(model, "model_args", None), "coda", None)
    if ck is None or not ck.enable or scaling is None or coda is None or coda.precision != "fp8":
        return False
    state = Fp8ScalingState(scaling)
    load = ck.load

    def load_then_histories(step: int = -1) -> bool:
        loaded = load(step=step)
        path = os.path.join(ck.folder, f"step-{trainer.step}")
        if loaded and os.path.isfile(os.path.join(path, ".metadata")):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemReader

            saved = FileSystemReader(path).read_metadata().state_dict_metadata
            layout = saved_layout(saved)
            world, rank = _world_rank()
            if layout == ("ranks", world) or layout == ("one", 1):
                prefix = f"{KEY}.rank{rank}." if layout[0] == "ranks" else f"{KEY}."
                # (only what that checkpoint holds: one older than a history starts that one afresh)
                current = {k: v for k, v in scaling.checkpoint_state().items() if prefix + k in saved}
                sd = {KEY: {f"rank{rank}": current} if layout[0] == "ranks" else current}
                dcp.load(sd, checkpoint_id=path)
                state.load_state_dict(sd[KEY])
            elif layout is not None and rank == 0:
                logger.warning(f"coda_titan: the fp8 amax histories in {path} were saved by {layout[1]} data-parallel "
                               f"ranks and this run has {world}: the fp8 scales calibrate afresh")
        ck.states[KEY] = state
        return loaded

    ck.load = load_then_histories
    return True


def saturation_report(trainer) -> str | None:
    """The CODA fp8 model's line on clamped delayed scales (``Fp8Scaling.saturation_report``), or None."""
    model = trainer.model_parts[0] if trainer is not None and len(trainer.model_parts) == 1 else None
    scaling = getattr(model, "fp8_scaling", None)
    return None if scaling is None else scaling.saturation_report()
