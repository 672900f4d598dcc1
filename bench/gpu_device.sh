#!/usr/bin/env bash
# The GPU check on the GPU check machine as it is (issue 37; docs/benchmarks.md): that machine's own python3, torch
# and Triton, the wheels bench/gpu_prepare.py put in .whl/ (carried with the working tree), and the checkout
# uninstalled; never Ray. Prints one table and exits non-zero when a goal is missed or the run outlasts 6 minutes.
#   bash bench/gpu_device.sh            # there; `--dry` runs the same on a CPU (tests/bench/test_gpu_check.py)
# GENSERVE_PYTHON: the interpreter (python3); GENSERVE_SITE: where the wheels are installed (/tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${GENSERVE_PYTHON:-python3}
site=${GENSERVE_SITE:-/tmp/site}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 360 "$python" -P bench/gpu_check.py --device-run "$@"
