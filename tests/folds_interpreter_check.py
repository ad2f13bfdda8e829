"""Run by tests/test_probes.py in a subprocess with TRITON_INTERPRET=1: the one-launch sum candidates of
``scripts/probes/folds.py`` (a 2-d tile of partials a program) on CPU tensors, through Triton's interpreter,
against the fp64 sums, with the probe's own bound. Prints one JSON line of measurements; the test judges them."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the checkout: ``scripts`` is not installed)
from scripts.probes import folds  # noqa: E402

torch.manual_seed(0)
got = {}
for r, c in ((300, 11), (70, 200)):  # (ragged row blocks; more columns than one tile)
    s, f = torch.randn(r, c) * 100, torch.rand(r) + 0.5
    got[f"rows_{r}x{c}"] = folds.sum_err_over_bound(folds.rows_one_launch(s, f, br=64), s, f, 1)
for t, n in ((128, 200), (40, 64)):  # (ragged column blocks; a row count not a multiple of the tile's)
    p, sc = torch.randn(t, n), torch.tensor([2.0**-9 * 1.37])
    got[f"cols_{t}x{n}"] = folds.sum_err_over_bound(folds.cols_one_launch(p, sc, bn=64), p, sc, 0)
s = torch.randn(50, 9)  # (a wrong result is far over the bound: the probe's judge can fail)
got["wrong_over_bound"] = folds.sum_err_over_bound(s.sum(1) * 1.001, s, torch.ones(50), 1)
print(json.dumps(got))
