"""Worker of tests/test_fsdp.py: the debug CODA model (torch backend, fp32) trained for a few steps on
one fixed global batch, on one process or sharded with FSDP2 / HSDP over gloo (launched by torchrun).

    python -m tests.fsdp_worker single OUT_DIR [CKPT_TO_CHECK]
    torchrun --nproc_per_node 2 -m tests.fsdp_worker sharded OUT_DIR     (fsdp, hsdp, fsdp in fp8)

Each rank takes its rows of the global batch; the loss is the summed token cross-entropy over the
global token count (TorchTitan's convention, FSDP's gradient division off), so the sharded runs
compute the single process's gradient up to the order of float32 sums. Writes OUT_DIR/<mode>.json
(per-step global loss; ``<mode>_fp8.json`` for precision = "fp8", the exact emulation); the fsdp run also saves a DCP checkpoint of the final model and its full
parameters (OUT_DIR/fsdp_full.pt). ``single`` given CKPT_TO_CHECK loads that checkpoint into a fresh
CODA model and into stock llama3, and reports whether both equal the saved full parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

STEPS, BATCH, SEQ = 6, 4, 32


def build(stock: bool = False, precision: str = "bf16"):
    from torchtitan.models.llama3 import Transformer

    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.job_config import Coda

    args = dataclasses.replace(coda_llama3_args["debugmodel"], coda=Coda(backend="torch", precision=precision))
    torch.manual_seed(0)
    model = Transformer(args) if stock else CodaTransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def train(mode: str, out: str, precision: str = "bf16") -> None:
    import torch.distributed as dist

    model = build(precision=precision)
    rank, world = 0, 1
    if mode != "single":
        from torch.distributed.device_mesh import init_device_mesh

        from coda_titan.titan.parallelize import apply_fsdp

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        shape, names = ((world,), ("fsdp",)) if mode == "fsdp" else ((world, 1), ("dp_replicate", "fsdp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    unshards = {"sync": 0, "async": 0}  # the model's own early gathers (FSDP's hooks do not call unshard())
    if mode != "single":
        from torch.distributed.fsdp import FSDPModule

        plain = FSDPModule.unshard

        def counted(self, async_op=False):
            unshards["async" if async_op else "sync"] += 1
            return plain(self, async_op=async_op)
        FSDPModule.unshard = counted
    reduced = []  # the FSDP units in the order their gradients are reduce-scattered (last step)
    if mode != "single":
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        names = {id(m): n or "root" for n, m in model.named_modules()}
        plain_pb = FSDPParamGroup.post_backward

        def recorded(self, *a, **k):
            reduced.append(names.get(id(self.modules[0]), "?"))
            return plain_pb(self, *a, **k)
        FSDPParamGroup.post_backward = recorded
    tokens, labels = batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    losses = []
    for _ in range(STEPS):
        reduced.clear()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[rows], labels=labels[rows]) / (BATCH * SEQ)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item())
    gammas_match = None
    if world > 1:
        FSDPModule.unshard = plain
        FSDPParamGroup.post_backward = plain_pb
        # the gamma-only gather gives what FSDP's all-gather in the parameter dtype gives (trained gammas)
        from coda_titan.model.model import _attention_gammas

        layers = list(model.layers.values())
        fulls = [layer.attention_norm.weight.full_tensor() for layer in layers]
        gammas_match = all(torch.equal(g, f.to(torch.bfloat16)) for g, f in zip(_attention_gammas(layers, torch.bfloat16), fulls))
        gammas_match = gammas_match and any(not torch.equal(f, torch.ones_like(f)) for f in fulls)
        dist.barrier()
    if mode == "fsdp" and precision == "bf16":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(out, "fsdp_ckpt"))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out, "fsdp_full.pt"))
    if rank == 0:
        with open(os.path.join(out, f"{mode}{'_fp8' if precision == 'fp8' else ''}.json"), "w") as f:
            json.dump({"losses": losses, "unshards": unshards, "layers": len(model.layers), "gammas_match": gammas_match,
                       "reduced": reduced}, f)


def check_checkpoint(ckpt: str, out: str) -> None:
    """Load the sharded checkpoint on one process into CODA and into stock llama3."""
    import torch.distributed.checkpoint as dcp

    full = torch.load(os.path.join(out, "fsdp_full.pt"))
    result = {}
    for name, stock in (("coda", False), ("stock", True)):
        model = build(stock)
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd)
        result[name] = all(torch.equal(p, full[n]) for n, p in model.named_parameters())
        result[f"{name}_keys"] = sorted(n for n, _ in model.named_parameters()) == sorted(full)
    with open(os.path.join(out, "checkpoint.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    for m, precision in ([("fsdp", "bf16"), ("hsdp", "bf16"), ("fsdp", "fp8")] if mode == "sharded"
                         else [(mode, "bf16"), (mode, "fp8")]):
        train(m, out, precision)
    if mode == "sharded":
        import torch.distributed as dist

        dist.destroy_process_group()
    if len(sys.argv) > 3:
        check_checkpoint(sys.argv[3], out)
