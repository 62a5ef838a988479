#!/usr/bin/env python3
"""Reference GGUF files from llama.cpp's own converter (convert_hf_to_gguf.py), for tests and for
checking what qconvert writes against what llama.cpp's authors write.

    python scripts/llama_cpp_reference.py MODEL_DIR OUT.gguf [--outtype f32] [--pre NAME] [--llama-cpp DIR]
        [--model-name NAME]

DIR is a llama.cpp source tree holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (for example the
``vendor/llama.cpp`` folder of the llama-cpp-python sdist, which scripts/test_env.d/30-llama-cpp-src.sh
extracts into tests/_fixtures/llama_cpp_src). Default: $QCONVERT_LLAMA_CPP_SRC, else that fixture folder.

The converter runs unchanged in a child Python process, with two patches for our test tokenizers (byte-level
BPE trained in code, tokenizer.json only), neither touching a tensor or a model hyperparameter:
* the BPE pre-tokenizer check (``TextModel.get_vocab_base_pre``), which hashes the tokenizer's output on a
  fixed text and refuses any tokenizer it has not seen, returns the fixed name ``--pre``;
* Gemma 2's ``set_vocab`` reads only a SentencePiece tokenizer.model; without one it takes the BPE path
  (``_set_vocab_gpt2``), as the converter's own Gemma 3 ``set_vocab`` does; Gemma 4's reads only a llama-style
  (byte_fallback BPE) tokenizer.json, and takes the same BPE path for a byte-level one.
The child imports the converter from DIR first, so it uses DIR's vendored gguf-py (the converter puts
it on sys.path itself) rather than the gguf package installed in the environment.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = REPO_ROOT / "tests" / "_fixtures" / "llama_cpp_src"
ENV_SRC = "QCONVERT_LLAMA_CPP_SRC"

# Runs in the child: argv = [src_dir, pre_name, converter args...]. The converter's package is imported
# (and patched) before its script runs, and the script then finds the same, patched module.
_CHILD = r"""
import runpy, sys
src, pre, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, src)
import conversion.base as base
import gguf
if not gguf.__file__.startswith(src):
    raise SystemExit(f"expected the gguf-py vendored in {src}, got {gguf.__file__}")
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import conversion.gemma as gemma
sentencepiece_vocab = gemma.Gemma2Model.set_vocab
def gemma2_vocab(self):
    if (self.dir_model / "tokenizer.model").is_file():
        return sentencepiece_vocab(self)
    self._set_vocab_gpt2()
gemma.Gemma2Model.set_vocab = gemma2_vocab
# Gemma 4's reads a llama-style (byte_fallback) tokenizer.json only; a byte-level one takes the BPE path
gemma4_hf_vocab = gemma.Gemma4Model.set_vocab
def gemma4_vocab(self):
    import json as _json
    model = _json.loads((self.dir_model / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    if model.get("byte_fallback"):
        return gemma4_hf_vocab(self)
    self._set_vocab_gpt2()
gemma.Gemma4Model.set_vocab = gemma4_vocab
# `--jobs JSON`: several conversions (a list of argument lists) in this one process, which imports torch once
import json
for job in (json.loads(args[1]) if args[:1] == ["--jobs"] else [args]):
    sys.argv = [src + "/convert_hf_to_gguf.py", *job]
    runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_src(explicit: str | os.PathLike | None = None) -> Path:
    """The llama.cpp source folder: ``explicit``, else $QCONVERT_LLAMA_CPP_SRC, else the test fixture
    folder. Raises FileNotFoundError when it has no convert_hf_to_gguf.py."""
    src = Path(explicit or os.environ.get(ENV_SRC) or DEFAULT_SRC).resolve()
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(
            f"no convert_hf_to_gguf.py in {src}: pass --llama-cpp DIR, set ${ENV_SRC}, or run "
            "scripts/test_env.d/30-llama-cpp-src.sh")
    return src


def reference_command(model_dir, out_path, outtype: str = "f32", pre: str = "qwen2",
                      src: str | os.PathLike | None = None, model_name: str | None = None,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
    """The child-process command line that converts ``model_dir`` to ``out_path`` (``extra_args``: more of
    the converter's own flags, e.g. ``--no-mtp``)."""
    cmd = [sys.executable, "-c", _CHILD, str(llama_cpp_src(src)), pre,
           str(Path(model_dir).resolve()), "--outfile", str(Path(out_path).resolve()), "--outtype", outtype]
    if model_name:
        cmd += ["--model-name", model_name]
    return cmd + list(extra_args)


def convert_reference(model_dir, out_path, outtype: str = "f32", pre: str = "qwen2",
                      src: str | os.PathLike | None = None, timeout: float = 600,
                      model_name: str | None = None, extra_args: tuple[str, ...] = ()) -> Path:
    """Convert an HF model folder with llama.cpp's converter; returns ``out_path``. Raises
    RuntimeError with the converter's output when it fails.

    ``model_name`` sets general.name (by default the converter derives it from the folder name). It
    matters to llama.cpp: a general.name containing "phi3" or "phi-3" makes its vocab loader look up
    Phi-3's "</s>", "<unk>" and "<s>" tokens and fail ("unordered_map::at") on a vocab without them."""
    cmd = reference_command(model_dir, out_path, outtype, pre, src, model_name, extra_args)
    # NO_LOCAL_GGUF would make the converter take the installed gguf package instead of its own
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not Path(out_path).is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}) on {model_dir}:\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return Path(out_path)


def convert_references(jobs, outtype: str = "f32", pre: str = "qwen2", src: str | os.PathLike | None = None,
                       timeout: float = 1200) -> list[Path]:
    """Several conversions in one child process (torch and the converter imported once): ``jobs`` is a list of
    (model_dir, out_path, model_name or None[, the converter's extra flags]). Returns the out paths; RuntimeError
    as convert_reference. The converter sets some flags on its model classes for the rest of the process
    (``--no-mtp``: Model.no_mtp = True), so the jobs with extra flags run after those without."""
    import json

    args = []
    for model_dir, out_path, model_name, *extra in sorted(jobs, key=lambda job: bool(job[3:] and job[3])):
        job = [str(Path(model_dir).resolve()), "--outfile", str(Path(out_path).resolve()), "--outtype", outtype]
        args.append(job + (["--model-name", model_name] if model_name else []) + list(extra[0] if extra else ()))
    cmd = [sys.executable, "-c", _CHILD, str(llama_cpp_src(src)), pre, "--jobs", json.dumps(args)]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    missing = [str(job[1]) for job in jobs if not Path(job[1]).is_file()]
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}; not written: {missing}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [Path(job[1]) for job in jobs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="HF model folder (config.json, safetensors, tokenizer files)")
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0", "auto"])
    ap.add_argument("--pre", default="qwen2", help="tokenizer.ggml.pre to write (default qwen2)")
    ap.add_argument("--model-name", default=None,
                    help="general.name to write (default: derived from MODEL_DIR's name by the converter)")
    ap.add_argument("--llama-cpp", dest="src", default=None,
                    help=f"llama.cpp source folder (default ${ENV_SRC}, else {DEFAULT_SRC})")
    args = ap.parse_args(argv)
    try:
        out = convert_reference(args.model_dir, args.out, args.outtype, args.pre, args.src,
                                model_name=args.model_name)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"llama_cpp_reference: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
