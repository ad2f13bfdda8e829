#!/bin/bash
# A Python 3.12 venv (default /tmp/v312) in which scripts.dev.compile_check compiles the CuTeDSL kernels
# without a GPU: the GPU host's pins (CuTeDSL, quack, torch 2.11) and what coda_titan imports. About 5 GB.
set -euo pipefail
venv=${1:-/tmp/v312}
py=${PYTHON312:-python3.12}
"$py" -c "" 2>/dev/null || py=/root/.pyenv/versions/3.12.1/bin/python  # (a pyenv shim may name one it cannot run)
"$py" -m venv "$venv"
pip="$venv/bin/pip install -q"
$pip torch==2.11.0
$pip nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1
$pip --no-deps quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 torchtitan==0.2.2 \
  torchdata==0.11.0 tyro==1.0.17 docstring-parser typeguard shtab tomli
$pip datasets==4.7.0 einops tensorboard tokenizers numpy
echo "ready: PYTHONPATH=. $venv/bin/python -m scripts.dev.compile_check"
