#!/usr/bin/env bash
# The pure-Python wheels that the GPU host's offline bundle (../shared/gpu/make-bundle) lacks, downloaded into
# .gpu/extra (git-ignored, as the bundle): a device call carries ".gpu/extra" beside ".gpu/part2", and
# scripts/gpu_train.sh puts them on PYTHONPATH. Today one: liger-kernel, the Liger baseline's kernels, at the
# version pyproject.toml's [liger] extra pins.
#
#   bash scripts/dev/extra_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
pin=$(grep -o '"liger-kernel==[^"]*"' pyproject.toml | tr -d '"')
[ -n "$pin" ] || { echo "no liger-kernel pin in pyproject.toml" >&2; exit 2; }
rm -rf .gpu/extra && mkdir -p .gpu/extra
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/extra "$pin"
ls -la .gpu/extra
