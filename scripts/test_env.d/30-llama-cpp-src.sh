# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py with its conversion/ package and vendored
# gguf-py), the reference writer that scripts/llama_cpp_reference.py runs for the architecture tests.
# PyPI's llama-cpp-python sdist vendors the llama.cpp tree its C library is built from, so the converter
# matches the llama.cpp that loads the files; only those three paths are kept, in
# tests/_fixtures/llama_cpp_src/. The version is the one constraints.txt pins.
# Sourced by scripts/run_tests.sh (VENV, PIP set); also runnable on its own:
#   VENV=.venv bash scripts/test_env.d/30-llama-cpp-src.sh
# Idempotent: an existing extraction is left alone.
(
    set -euo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/../.."
    dest=tests/_fixtures/llama_cpp_src
    [ -f "$dest/convert_hf_to_gguf.py" ] && exit 0
    version=$(sed -n 's/^llama-cpp-python==\([^[:space:]]*\).*/\1/p' constraints.txt)
    [ -n "$version" ] || { echo "30-llama-cpp-src.sh: no llama-cpp-python pin in constraints.txt" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "${VENV:-.venv}/bin/python" -m pip download --disable-pip-version-check -q \
        "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$tmp/dl"
    sdist=$(ls "$tmp"/dl/llama_cpp_python-"$version".tar.gz)
    top="llama_cpp_python-$version/vendor/llama.cpp"
    mkdir -p "$tmp/x"
    # (gguf-py's own tests are left out: they are not ours to run)
    tar -xzf "$sdist" -C "$tmp/x" --wildcards --exclude "$top/gguf-py/tests" \
        "$top/convert_hf_to_gguf.py" "$top/conversion/*" "$top/gguf-py/*"
    # move into place only when complete, so an interrupted run is retried rather than half-used
    mkdir -p "$(dirname "$dest")"
    rm -rf "$dest"
    mv "$tmp/x/$top" "$dest"
)
