"""The CODA layers compile with torch.compile(fullgraph=True): no graph breaks around the programs.

Two program sets: the torch reference functions, and the ``torch.ops.coda`` custom ops (one opaque
node per program; on CPU they run the reference, so the numbers must match exactly as eager). And
the FA4 attention op in place of SDPA (again one opaque node, with its CPU reference kernel). And
precision = "fp8" (its Functions share the bf16 backward bodies, which dynamo must trace).
"""

import dataclasses

import pytest
import torch

from coda_titan.kernels import op_backend
from coda_titan.model.args import CodaModelArgs
from coda_titan.titan.fa4 import swap_attention
from coda_titan.model.model import CodaTransformer
from coda_titan.titan.job_config import Coda


@pytest.mark.parametrize(
    "programs,attention,precision",
    [("torch", "sdpa", "bf16"), ("custom_ops", "sdpa", "bf16"), ("torch", "fa4_op", "bf16"),
     ("torch", "sdpa", "fp8"), ("custom_ops", "fa4_op", "fp8"), ("custom_ops", "sdpa", "fp8_dgrad"),
     ("custom_ops", "sdpa", "fp8_mlp_dgrad")],  # fp8_mlp_dgrad: with fp8_mlp_wgrad too (the defaults)
)
def test_layers_compile_fullgraph_and_match_eager(programs, attention, precision):
    torch._dynamo.reset()  # each case compiles the same block code afresh (recompile limit)
    torch.manual_seed(0)
    kw = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=32, max_seq_len=16)
    coda = Coda(backend="torch", tile_n=32, precision=precision.split("_")[0], fp8_dgrad=precision == "fp8_dgrad",
                fp8_mlp_dgrad=precision == "fp8_mlp_dgrad", fp8_mlp_wgrad=precision == "fp8_mlp_dgrad")
    model = CodaTransformer(CodaModelArgs(**kw, coda=coda))
    with torch.no_grad():
        model.init_weights()
    if attention == "fa4_op":  # the FA4 custom op (its CPU reference kernel here)
        assert swap_attention(model) == len(model.layers)
    tokens = torch.randint(0, 61, (2, 16))
    labels = torch.randint(0, 61, (2, 16))
    if precision.startswith("fp8"):  # calibrate first, so that eager and compiled both use the delayed scales
        with torch.no_grad():
            model(tokens, labels=labels)
    if precision == "fp8_mlp_dgrad":  # and the gradients' (same data and weights: the same amaxes again)
        model(tokens, labels=labels).backward()
        model.zero_grad()
    history = model.fp8_scaling.activation_history.clone()
    eager = model(tokens, labels=labels)
    eager.backward()
    model.fp8_scaling.activation_history.copy_(history)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if programs == "custom_ops":
        cfg = dataclasses.replace(model.program_config(), backend=op_backend())
        model.program_config = lambda: cfg
    for layer in model.layers.values():
        layer.compile(fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
    compiled = model(tokens, labels=labels)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
