#!/usr/bin/env bash
# marft's GPU check on a machine lent a GPU (see scripts/gpu_check.py): unpack what the image lacks
# (.gpu/, built here by `python scripts/gpu_check.py bundle`), then run the check.
#   bash scripts/gpu_check.sh                 # on the GPU, into $OUT (or /tmp/marft-gpu-check-out)
#   DEV=cpu bash scripts/gpu_check.sh --quick # the dry run with a tiny model on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/site.tar.xz ]; then
  site=/tmp/marft-gpu-site
  mkdir -p "$site" && tar -xJf .gpu/site.tar.xz -C "$site"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${PYTHON:-python3}
exec "$PY" scripts/gpu_check.py run --dev "${DEV:-cuda}" --out "${OUT:-/tmp/marft-gpu-check-out}" "$@"
