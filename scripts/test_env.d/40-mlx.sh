# MLX: mlx (CPU build) and mlx-lm, the producer (mlx_lm.convert -q) and the consumer (mlx_lm.load,
# mx.dequantize, generation) of the MLX tests (tests/formats/mlx/test_mlx.py, through tests/support/mlx_driver.py).
# mlx-lm pulls its own transformers, so it lives in its own environment, <repo>/.venvs/mlx, never the main one.
# Sourced by scripts/run_tests.sh (VENV, PIP set); also runnable on its own: bash scripts/test_env.d/40-mlx.sh
# Idempotent: a complete environment is left alone.
(
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/../.."
    mlx_venv=.venvs/mlx
    mlx_py="$mlx_venv/bin/python"
    if [ -x "$mlx_py" ] && "$mlx_py" -c 'import mlx.core, mlx_lm, torch, safetensors' 2>/dev/null; then
        exit 0
    fi
    mkdir -p .venvs
    [ -x "$mlx_py" ] || "${PYTHON:-python3}" -m venv "$mlx_venv"
    mlx_pip=("$mlx_py" -m pip --disable-pip-version-check -q)
    pin=$(mktemp)
    trap 'rm -f "$pin"' EXIT
    echo "torch==2.13.0" > "$pin"
    # torch (the CPU build, pinned) for the driver's comparisons; mlx[cpu] is the Linux CPU backend
    "${mlx_pip[@]}" install -c "$pin" torch==2.13.0
    "${mlx_pip[@]}" install -c "$pin" "mlx[cpu]==0.32.4" "mlx-lm==${QCONVERT_MLX_LM_VERSION:-0.32.2}" safetensors numpy
)
