#!/usr/bin/env bash
# The accelerator check: one CUDA GPU against the CPU, and a slice of the main job (FEAST
# CIFAR-100, 2 rounds, fp32 and bf16, 2 ranks sharing the GPU, throughput against a dense loop);
# one summary line per check (PASS, FAIL, INFO) and a count; at most 8 minutes on one H200.
# Without a CUDA GPU it stops at once with one line and exit status 2. What each check
# compares, and its tolerance: benchmarks/device_check.py and benchmarks/main_job_check.py.
#
#   benchmarks/device_check.sh [--out DIR]        # keep the runs in DIR
#   benchmarks/device_check.sh --cpu-smoke        # every part on the CPU at small sizes
#   PYTHON=/path/to/python benchmarks/device_check.sh
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
if ! command -v "$python" >/dev/null 2>&1; then
    echo "device_check: no python at '$python'; set PYTHON to the interpreter that has fl_lightning" >&2
    exit 2
fi
exec "$python" "$here/device_check.py" "$@"
