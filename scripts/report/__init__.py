"""Generated documents: every number in them comes from ``benchmarks/results/*.json``.

    python -m scripts.report [--parts DIR ...]

writes ``docs/results.md`` (the kernel benchmark, the training comparisons, loss curves, run-to-run
spread and profiles, with their plots) and the README's generated blocks (the headline results and
the ``[coda]`` table from the schema). ``--parts`` first merges kernel benchmark parts
(``scripts/bench/kernels.py`` output folders) into the stored kernel JSON.
"""
