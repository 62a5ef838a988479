"""Generate a few tokens from a GGUF with llama.cpp (llama-cpp-python), if it is installed.

The bundled model has random weights, so the text is noise: the point is that llama.cpp loads the
file and runs it.    python scripts/sample_generation.py MODEL.gguf [PROMPT]
"""

from __future__ import annotations

import sys


def main() -> int:
    path = sys.argv[1]
    prompt = sys.argv[2] if len(sys.argv) > 2 else "the quantized model"
    try:
        import llama_cpp  # noqa: F401  (only whether it is installed)
    except ImportError:
        print("llama-cpp-python is not installed; skipping the sample generation "
              "(pip install -e '.[llama]' to add it)")
        return 0
    from qconvert.converters.apps.runtimes import llama_cpp_model

    llm = llama_cpp_model(path, n_ctx=128, n_threads=2, verbose=False, seed=0)
    try:
        out = llm(prompt, max_tokens=16, temperature=0.0)
    finally:
        llm.close()
    print(f"llama.cpp sample ({path}): {prompt!r} -> {out['choices'][0]['text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
