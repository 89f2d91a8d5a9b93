#!/usr/bin/env bash
# The checks only a machine with a CUDA device can make (issue 15), in a few minutes, from the repository root:
#   scripts/gpu_check.sh
# 1. the CUDA tests, which skip elsewhere: DistributedLion on CUDA steps as on CPU; packing, voting and the
#    sign unpacking on CUDA equal the CPU's bit for bit;
# 2. the GPU rows of make bench (benchmarks/bench_gpu.py): DistributedLion against timm's Lion, and a simulated
#    D-Lion step of 8 workers against 8 Lion steps, printed (results/bench.md is left as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || make setup
.venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')"
.venv/bin/pytest -q -rs tests/test_torchdist.py tests/test_packing.py -k cuda
.venv/bin/python scripts/bench.py gpu
