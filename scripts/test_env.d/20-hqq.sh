# HQQ: a separate environment for the hqq library, the producer and reference loader of the HQQ tests.
# hqq 0.2.8.post1's transformers-safetensors path needs transformers 4.57.x (5.x cannot quantize with
# HqqConfig and silently loads HQQ checkpoints with random weights), which conflicts with the main venv's
# transformers 5.24 (gptqmodel's pin). Tests find this environment at <repo>/.venvs/hqq.
# Sourced by scripts/run_tests.sh (VENV, PIP set); also runnable on its own: bash scripts/test_env.d/20-hqq.sh
# Idempotent: a complete environment is left alone.
(
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/../.."
    hqq_venv=.venvs/hqq
    hqq_py="$hqq_venv/bin/python"
    if [ -x "$hqq_py" ] && "$hqq_py" -c 'import hqq, transformers, torch, safetensors; assert transformers.__version__ == "4.57.6"' 2>/dev/null; then
        exit 0
    fi
    mkdir -p .venvs
    [ -x "$hqq_py" ] || "${PYTHON:-python3}" -m venv "$hqq_venv"
    hqq_pip=("$hqq_py" -m pip --disable-pip-version-check -q)
    pin=$(mktemp)
    trap 'rm -f "$pin"' EXIT
    echo "torch==2.13.0" > "$pin"
    # torch first, the CPU build pinned, so that no later requirement swaps it for a CUDA build
    "${hqq_pip[@]}" install -c "$pin" torch==2.13.0
    # hqq ships as an sdist whose setup.py builds a CUDA extension unless DISABLE_CUDA=1
    DISABLE_CUDA=1 "${hqq_pip[@]}" install -c "$pin" hqq==0.2.8.post1 transformers==4.57.6 safetensors accelerate
)
