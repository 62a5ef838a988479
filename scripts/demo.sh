#!/usr/bin/env bash
# Install qconvert into .venv and convert the bundled tiny GPTQ checkpoint to GGUF, printing the
# per-tensor verdicts and, where llama-cpp-python is installed, a sample generation from llama.cpp.
#   bash scripts/demo.sh [OUT.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QCONVERT_VENV:-.venv}
OUT=${1:-tiny-llama-q4_0.gguf}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -c constraints.txt torch==2.13.0
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -c constraints.txt -e .
"$VENV/bin/qconvert" 'gptq->gguf' examples/tiny-llama-gptq-4bit "$OUT" --force --report "${OUT%.gguf}.report.json"
"$VENV/bin/python" scripts/sample_generation.py "$OUT"
