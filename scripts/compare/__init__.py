"""Step-time comparison of training configs, a loss-parity mode, and a kernel profile.

    python -m scripts.compare CONFIG.toml [CONFIG.toml ...] [--steps 50] [--warmup 10]
    python -m scripts.compare --loss-curve BASELINE.toml CODA.toml [MORE.toml ...] [--steps 300]
    python -m scripts.compare --profile CONFIG.toml [--steps 20]
    python -m scripts.compare --report          # tables, plots and README from the committed JSON

Every run is a real ``coda-titan train`` in its own process (TorchTitan's Trainer, same data and seed),
with ``metrics.log_freq = 1`` (``--log-freq N``: every N steps, as the configs log; each line's ``.item()``
calls wait for the GPU) and its own output folder. The numbers are TorchTitan's own metrics as it prints
them (loss, peak reserved memory, tokens/s over the steps since the line before, MFU); the step time is
tokens per step / tokens/s. The first ``--warmup`` steps (compilation, autotuning, allocator growth) are
excluded from the timing; the loss list holds every logged step. Each run's W&B history is read back from its offline run folder
and checked to hold the loss series.

``--attention fa4|sdpa`` sets the attention of every config (the default keeps what each config says),
so a comparison changes one thing at a time. ``--set KEY=VALUE`` passes a TorchTitan override to every
run (for example ``--set compile.enable=true``).

Results go to ``benchmarks/results/`` (``--out``): ``compare_<gpu>_<date>.json`` (+ ``.png``),
``loss_curve_<gpu>_<date>.json`` (+ ``.png``), ``profile_<config>_<gpu>_<date>.json``. Each JSON
holds the device, date, versions, exactly what was run and the raw per-step values. ``--report``
(the same as ``python -m scripts.report``) regenerates the plots, docs/results.md and the README's
headline from those files only; no number is typed by hand. ``--no-plot`` writes the JSON alone (the
device calls, which return few files); the report draws each stored result's missing plot. The results
page also gets, from the stored loss curves, the run-to-run spread of repeated stock runs (the noise any
parity criterion has to live with) and the step where they disagree most, and, from the profiles, the
GEMM time a CODA config would have left for its speed-up target.

Modules: ``run`` (one config in its own process; the comparison mode), ``loss_curve`` and
``parity``, ``profile`` (the torch profiler and trace analysis), ``targets``, ``common`` (paths,
naming, the TOML writer), ``wandb_history`` (reads an offline W&B run back).
"""


from scripts.compare.common import PARITY_SKIP, PARITY_TOL, RESULTS, ROOT, _attention_of, dump_toml, with_attention  # noqa: E402,F401
from scripts.compare.parity import (against_repeats, consensus_spread, fragile_step, loss_runs, parity,  # noqa: E402,F401
                                    repeat_spread, spread_tables, track_record, track_record_table,
                                    against_noise_floor)
from scripts.compare.profile import idle_gaps, kernel_category, summarize_trace  # noqa: E402,F401
from scripts.compare.run import parse_log, run_config, summarize  # noqa: E402,F401
from scripts.compare.targets import budget_lines, profile_side_by_side, targets  # noqa: E402,F401
from scripts.compare.cli import main  # noqa: E402,F401
