#!/usr/bin/env bash
# On the GPU host (after `source .gpu/part2/activate.sh`): the CPU-level tests under the host's
# torch, then a short 1B run of the CODA config and of its baseline through `coda-titan train`.
# Logs go to $OUT (or ./outputs/gpu_smoke). Checks that the path works; it makes no timing claim.
set -uo pipefail
out=${OUT:-outputs/gpu_smoke}; mkdir -p "$out"
steps=${STEPS:-10}
export CODA_TITAN_CACHE=${CODA_TITAN_CACHE:-/tmp/coda_cache} PYTHONUNBUFFERED=1
python3 -c "import torch, torchtitan; print('torch', torch.__version__, torch.cuda.get_device_name(), '| torchtitan', torchtitan.__version__)" | tee "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_norm_rope.py tests/test_norm_swiglu.py tests/test_residual_rms.py tests/test_lm_head_ce.py 2>&1 | tail -3 | tee "$out/pytest.txt"
for cfg in llama3_1b_bf16_coda llama3_1b_bf16_baseline; do
  python3 -m coda_titan.cli train "configs/$cfg.toml" --training.steps "$steps" --metrics.log_freq 1 \
    --metrics.disable_color_printing --job.dump_folder "/tmp/smoke/$cfg" > "$out/$cfg.log" 2>&1
  echo "$cfg rc=$?"; grep -E "step: |error|Error" "$out/$cfg.log" | sed 's/.*root - INFO - //' | tail -$((steps + 2))
done
