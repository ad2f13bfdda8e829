"""The fp8 amax histories in TorchTitan's checkpoints, as a state of their own (``coda_fp8``).

The histories are not model parameters: in the model's state dict they would make every stock or
bf16 checkpoint unloadable into an fp8 model (DCP refuses a missing key). So they travel beside it:
after TorchTitan's ``CheckpointManager.load`` has run, the histories are read from the step it
loaded if that step has them (a run of ours resumed), and from then on every save writes them.
A checkpoint without them starts a fresh calibration, as before; stock llama3 ignores them.
Under FSDP2 each rank's histories are its own (local amaxes); DCP saves one rank's copy (it treats
a plain tensor as replicated), which every rank resumes from.
"""

from __future__ import annotations

import os

KEY = "coda_fp8"


class Fp8ScalingState:
    """``Stateful`` view of a model's ``Fp8Scaling`` for DCP."""

    def __init__(self, scaling):
        self.scaling = scaling

    def state_dict(self):
        return self.scaling.checkpoint_state()

    def load_state_dict(self, state_dict) -> None:
        self.scaling.load_checkpoint_state(state_dict)


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

            keys = FileSystemReader(path).read_metadata().state_dict_metadata
            if any(k.startswith(KEY + ".") for k in keys):
                sd = {KEY: state.state_dict()}
                dcp.load(sd, checkpoint_id=path)
                state.load_state_dict(sd[KEY])
        ck.states[KEY] = state
        return loaded

    ck.load = load_then_histories
    return True
