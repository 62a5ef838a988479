# mistral.rs, the UQFF producer and loader the UQFF tests check against (tests/formats/uqff/test_uqff.py).
# The PyPI wheel is a self-contained abi3 binary (no dependencies, no CLI: the Python API only), so it
# goes into the main test environment; --no-deps keeps it from touching any pin there.
# Sourced by scripts/run_tests.sh with VENV and PIP set. Idempotent.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mistralrs') != '0.9.5')" 2>/dev/null; then
    "${PIP[@]}" install --no-deps mistralrs==0.9.5
fi
