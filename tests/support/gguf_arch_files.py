"""What the GGUF architecture tests (tests/formats/gguf/test_gguf_archs*.py) share: the fixture cache, llama.cpp's
converter as the reference (skipped when it is not extracted: a failure under QCONVERT_REQUIRE_ORACLES), and the
comparisons of two GGUF files (their tensors' names, types, shapes and bytes; their `{arch}.*` keys)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest

from helpers import gguf_tensors

ROOT = Path(__file__).parents[1] / "_fixtures" / "archs"  # the built models and converted files, cached


def cached(path: Path, build: Callable[[Path], object]) -> Path:
    """`path`, built once by `build(path)` (a folder or a file); a `.done` marker beside it says it is complete,
    so that an interrupted build is redone rather than used."""
    done = path.with_name(path.name + ".done")
    if not done.exists():
        if path.is_dir():
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path)
        done.write_text("ok")
    return path


def converter():
    """scripts/llama_cpp_reference.py (llama.cpp's own convert_hf_to_gguf.py, run in a child process); the test
    is skipped when the converter is not extracted (tests/_fixtures/llama_cpp_src)."""
    import llama_cpp_reference as ref

    try:
        ref.llama_cpp_src()
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's converter is not extracted: {e}")  # a failure under QCONVERT_REQUIRE_ORACLES
    return ref


def model_keys(path: Path) -> dict:
    """A GGUF's model hyper-parameters: every key but the file's, general.* and tokenizer.* ones."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general.", "tokenizer."))}


def assert_same_model_keys(ours: Path, theirs: Path, extra: set = frozenset()) -> None:
    """The {arch}.* hyper-parameters of two GGUFs agree (floats as stored, FLOAT32), but for `extra` keys."""
    ka, kb = model_keys(ours), model_keys(theirs)
    assert set(ka) - set(extra) == set(kb)
    for key in kb:
        assert ka[key] == kb[key], (key, ka[key], kb[key])


def ggml_dims(shape, trim: bool = True) -> list[int]:
    """A tensor's ggml ne; `trim`: without trailing 1s, as llama-quantize writes every tensor (ggml_n_dims: the
    shared-expert gate [hidden, 1] of the converter's file is [hidden] in llama-quantize's)."""
    ne = [int(d) for d in shape]
    while trim and len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return ne


def same_tensors(ours: Path, theirs: Path, shapes: bool = True, trim_dims: bool = False) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type and bytes (and shape, unless `shapes` is False;
    `trim_dims`: compared as ggml_n_dims counts them, for llama-quantize's output); -> the types present."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        if shapes:
            assert ggml_dims(a[name].shape, trim_dims) == ggml_dims(b[name].shape, trim_dims), name
        assert bytes(a[name].data) == bytes(b[name].data), name
    return {t.tensor_type.name for t in a.values()}
