#!/usr/bin/env bash
# The cloud worker on one GPU, in one run (under 8 minutes on one large GPU): greedy exactness against HF
# `generate` (demo pair, and models/real/* when present) at float32 and bfloat16 through both attention paths,
# a verify step against a bare forward at batch 1/16/64 and context 64-2048, the batched attention path against
# the per-session one, and 16 sessions' throughput against one. Prints tables; writes OUT/gpu_check.json.
# Installs nothing: it runs the repository's own .venv (`make venv`, the pinned versions) or $PYTHON.
#   scripts/gpu_check.sh [--device cuda:N] [--out DIR] ...   (any `specrelay bench gpu` flag)
#   scripts/gpu_check.sh --device cpu                        (the same program at small sizes, on the CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    echo "gpu_check: $PYTHON not found; run 'make venv' first (or set PYTHON)" >&2
    exit 2
fi
exec "$PYTHON" -m specrelay.bench gpu "$@"
