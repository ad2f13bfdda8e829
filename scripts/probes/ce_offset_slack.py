"""Probe: how far the Cauchy-Schwarz bound on each LM-head row's logits lies above its largest logit, at the
1B's init weights and after training: the one unknown of an F4 without its gradient pass
(docs/cute_backend.md, "F4 without its gradient pass").

    source .gpu/part2/activate.sh && python3 -m scripts.probes.ce_offset_slack --state-steps 0 46 300
    python -m scripts.probes.ce_offset_slack --cpu                       (the debug model, init weights)

That design stores e = exp(l - c) in bf16 with c = B - 70, B = ||h|| max_n ||W_n|| (h a row of the head's input,
the final norm's output with its gamma, as F4's r * H): every logit is at most B, so no e passes e^70, and the
row's largest e is a normal bf16 while max_n l_n - c > -87, i.e. while the slack B - max_n l_n is under 157.
For each state (0: the init weights and random tokens; N: stock eager's weights after N steps of
``--state-config`` and the batch of its step N + 1, ``bf16_step_accuracy.trained_state``), stock llama3's forward
in bf16 gives h and the logits; per row: B (fp32, from the bf16 h and W), the largest logit and the log-sum-exp
(of the bf16 logits), the slack; the file has their quantiles, the largest slack, how many rows pass 150, and
max ||W_n|| against the median ||W_n||.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from coda_titan.kernels.lm_head_ce import EXP_FLOOR, EXP_MARGIN
from scripts.probes.bf16_step_accuracy import Setup, _params, _stock, trained_state

SLACK_LIMIT = EXP_MARGIN + EXP_FLOOR  # (the design's room: c = B - 70 and the top e a normal bf16 down to e^-87)
SLACK_WARN = 150.0  # (what its per-row check would report)
QUANTILES = (0.0, 0.01, 0.5, 0.99, 1.0)


def _quantiles(x: torch.Tensor) -> dict:
    q = torch.quantile(x.double().cpu(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {f"q{int(100 * k)}": float(v) for k, v in zip(QUANTILES, q)}


def slack(h: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor) -> dict:
    """The per-row numbers of one batch: h (rows, d) and the head's weight (V, d) in the model's dtype, the
    logits (rows, V) as the model made them."""
    h, weight, logits = h.detach(), weight.detach(), logits.detach()
    norms = weight.float().norm(dim=-1)
    bound = h.float().norm(dim=-1) * norms.max()
    top = logits.float().amax(-1)
    lse = torch.logsumexp(logits.float(), -1)
    gap = bound - top
    return {"rows": h.shape[0], "bound": _quantiles(bound), "max_logit": _quantiles(top), "lse": _quantiles(lse),
            "slack": _quantiles(gap), "slack_max": float(gap.max()),
            "rows_over_warn": int((gap > SLACK_WARN).sum()), "rows_over_limit": int((gap > SLACK_LIMIT).sum()),
            "weight_row_norm_max": float(norms.max()), "weight_row_norm_median": float(norms.median())}


def measure(s: Setup, state: tuple | None) -> dict:
    """``slack`` of stock llama3's forward on ``state`` (weights, tokens, labels), else its init weights and
    random tokens."""
    model = _stock(s, False)
    if state is None:
        vocab = model.model_args.vocab_size
        gen = torch.Generator(device=s.device).manual_seed(1)
        tokens = torch.randint(0, vocab, (s.batch, s.seqlen), generator=gen, device=s.device)
    else:
        weights, tokens, _ = state
        with torch.no_grad():
            for n, p in _params(model).items():
                p.copy_(weights[n])
    seen = {}
    hook = model.output.register_forward_hook(lambda mod, args, out: seen.update(h=args[0], logits=out))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    h = seen["h"].reshape(-1, seen["h"].shape[-1])
    return slack(h, model.output.weight, seen["logits"].reshape(h.shape[0], -1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="The Cauchy-Schwarz bound's slack over each LM-head row's largest logit.")
    ap.add_argument("--state-steps", type=int, nargs="+", default=[0],
                    help="0: the init weights and random tokens; N: the weights after N steps of --state-config")
    ap.add_argument("--state-config", default="configs/llama3_1b_bf16_baseline.toml")
    ap.add_argument("--workdir", default="/tmp/probe_state", help="where the training runs and their checkpoints go")
    ap.add_argument("--cpu", action="store_true", help="the debug model (debugmodel_gqa, seq 256 x batch 4) on the CPU")
    args = ap.parse_args(argv)
    from scripts.bench.common import header, out_json

    s = Setup(flavor="debugmodel_gqa", seqlen=256, batch=4, device="cpu", backend="torch", fa4=False) if args.cpu else Setup()
    path = out_json("probe_ce_offset_slack", cpu=args.cpu)
    doc = {**header(cpu=args.cpu), "kind": "probe_ce_offset_slack",
           "command": "python -m scripts.probes.ce_offset_slack " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": f"llama3/{s.flavor}", "seq_len": s.seqlen, "local_batch_size": s.batch,
           "state_config": args.state_config, "slack_limit": SLACK_LIMIT, "states": {}}
    for n in args.state_steps:
        state = trained_state(s, args.state_config, n, args.workdir) if n else None
        doc["states"][str(n)] = r = measure(s, state)
        print(f"state {n}: slack median {r['slack']['q50']:.1f} max {r['slack_max']:.1f} (rows over {SLACK_WARN:g}: "
              f"{r['rows_over_warn']}); max logit median {r['max_logit']['q50']:.1f}; bound median "
              f"{r['bound']['q50']:.1f}", flush=True)
        with open(path, "w") as f:  # (after each state: a call that times out keeps what it measured)
            json.dump(doc, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
