#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent) and run them. Used by .ci/run.
#   bash scripts/run_tests.sh [pytest args...]
# A fresh machine builds llama-cpp-python from source once (about 10 minutes on 2 cores; pip caches
# the wheel afterwards) and gptqmodel's fixtures take about 2 minutes on first use (cached in
# tests/_fixtures/).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QCONVERT_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first, from the exact CPU build (a bare requirement can pull a multi-GB CUDA build)
"${PIP[@]}" install -c constraints.txt torch==2.13.0
# llama.cpp: skip the multimodal library, which the tests do not use, to halve the build
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
"${PIP[@]}" install -c constraints.txt -e ".[test,gptq,llama,triton,batch,ct,bnb]"
export GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# a skipped oracle test is a failure here (tests/conftest.py): a run that proves nothing must not pass
export QCONVERT_REQUIRE_ORACLES="${QCONVERT_REQUIRE_ORACLES:-1}"
# Extra environments a format's tests need (a producer with conflicting pins, a runtime wheel) are set
# up by one fragment per format, each sourced here with VENV and PIP already set.
for fragment in scripts/test_env.d/*.sh; do
    [ -e "$fragment" ] || continue
    # shellcheck source=/dev/null
    source "$fragment"
done
exec "$VENV/bin/python" -m pytest "$@"
