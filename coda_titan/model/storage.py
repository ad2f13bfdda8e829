"""Parameters that one GEMM reads as a single weight, put in one buffer (``[coda] stacked_weights``).

F2 and the bf16 MLP dgrad read W13 = [w1; w3] (F2 interleaves its rows as its TMA loads them), F3 and the bf16
QKV dgrad W_qkv = [wq; wk; wv]. Where the weights' data are consecutive rows of one buffer, the kernels take that
buffer as a view (``kernels._common.stacked_rows``) instead of copying them into a new one every forward and
backward. The parameters stay ``nn.Parameter`` objects of their own with llama3's names and shapes (checkpoints,
optimizer state, FSDP units unchanged); only where their data lives changes. Anything that gives them new storage
(``to_empty``, FSDP2's sharding, AMP's casts) ends the sharing, and the kernels then copy, as they did before:
never a wrong read.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("coda_titan")


def share_storage(*params: torch.nn.Parameter) -> bool:
    """Give ``params`` (same dtype, device and trailing shape, plain tensors) consecutive rows of one new buffer,
    their values kept; False (nothing changed) where they cannot share one (a DTensor, a mismatch, meta)."""
    first = params[0]
    if any(type(p.data) is not torch.Tensor or p.is_meta or p.dtype != first.dtype or p.device != first.device
           or p.shape[1:] != first.shape[1:] for p in params):
        return False
    buf = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype, device=first.device)
    start = 0
    with torch.no_grad():
        for p in params:
            rows = buf[start:start + p.shape[0]]
            rows.copy_(p.data)
            p.data = rows
            start += p.shape[0]
    return True


def stack_layer_weights(layers) -> int:
    """Each block's (w1, w3) and (wq, wk, wv) in one buffer each (``init_weights`` with ``[coda] stacked_weights``);
    one log line where a group cannot share one (FSDP2's shards): its kernels then copy it, as without the knob.
    Returns the number of groups that share a buffer."""
    layers = list(layers)
    groups = [(b.feed_forward.w1, b.feed_forward.w3) for b in layers]
    groups += [(b.attention.wq, b.attention.wk, b.attention.wv) for b in layers]
    shared = sum(share_storage(*(m.weight for m in g)) for g in groups)
    if shared < len(groups):
        logger.info(f"coda_titan: [coda] stacked_weights: {len(groups) - shared} of {len(groups)} weight groups are "
                    "sharded or on no device and cannot share a buffer; their kernels copy them, as without the knob")
    return shared
