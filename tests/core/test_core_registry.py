"""converters/registry.py: names and aliases, lookups, and detecting a path's format from its data.

Formats registered here for a test are removed again (the registry is process-wide and every later test
reads it), by restoring `_REGISTRY` and `_ALIASES` to what they held before, in a `finally`."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from qconvert.converters import registry
from qconvert.converters.errors import QConvertError
from qconvert.converters.registry import (FormatEntry, all_formats, detect_format, get_format, normalize_name,
                                          register_format)


@contextmanager
def scratch_registry():
    """The registry as it is now, given back unchanged however the block ends."""
    all_formats()  # the built-in formats loaded first, so that they are part of what is restored
    saved_formats, saved_aliases = dict(registry._REGISTRY), dict(registry._ALIASES)
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved_formats)
        registry._ALIASES.clear()
        registry._ALIASES.update(saved_aliases)


def known_formats() -> str:
    return ", ".join(sorted(registry._REGISTRY))


def readable_formats() -> str:
    return ", ".join(e.name for e in all_formats() if e.can_read)


# ---- names ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, key", [
    ("GPTQ_v2", "gptq-v2"), ("  gguf ", "gguf"), ("Mistral.RS", "mistral.rs"), ("hqq lib", "hqq-lib"),
])
def test_normalize_name(name, key):
    assert normalize_name(name) == key


@pytest.mark.parametrize("name, fmt", [
    ("mistral.rs", "uqff"), ("MistralRS", "uqff"), ("llama.cpp", "gguf"), ("ggml", "gguf"), ("GPTQ_V2", "gptq-v2"),
    ("autogptq", "gptq"), ("safetensors", "hf"), ("hqq", "hqq"),
])
def test_get_format_by_name_or_alias(name, fmt):
    assert get_format(name).name == fmt
    assert get_format(name) is get_format(fmt)


def test_an_unknown_name_lists_the_known_formats():
    with pytest.raises(QConvertError) as info:
        get_format("eetq")
    assert str(info.value) == f"unknown format 'eetq'; known formats: {known_formats()}"
    for builtin in ("gguf", "gptq", "hf", "uqff"):
        assert builtin in known_formats().split(", ")


def test_all_formats_is_sorted_by_name():
    names = [e.name for e in all_formats()]
    assert names == sorted(names) and len(names) == len(set(names))


# ---- register_format ------------------------------------------------------------------------------------

def test_register_format_adds_a_format_reachable_by_its_aliases():
    with scratch_registry():
        entry = register_format(FormatEntry("Test_Format", aliases=("test.alias",)))
        assert get_format("test-format") is entry
        assert get_format("TEST.ALIAS") is entry
        assert register_format(entry) is entry  # the same entry again (a module imported twice) is no clash
    assert "test-format" not in registry._REGISTRY and "test.alias" not in registry._ALIASES


def test_register_format_refuses_a_name_already_taken():
    with scratch_registry():
        gguf = get_format("gguf")
        with pytest.raises(ValueError) as info:
            register_format(FormatEntry("GGUF"))
        assert str(info.value) == "format 'gguf' is already registered"
        assert get_format("gguf") is gguf


def test_register_format_refuses_an_alias_that_names_another_format():
    with scratch_registry():
        with pytest.raises(ValueError) as info:
            register_format(FormatEntry("test-format", aliases=("Llama.cpp",)))
        assert str(info.value) == "alias 'llama.cpp' already names format 'gguf'"
        assert get_format("llama.cpp").name == "gguf"


# ---- detect_format and what a path holds ------------------------------------------------------------------

def write_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_dense_hf(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8, dtype=torch.float16)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def detect_refusal(path: Path) -> str:
    with pytest.raises(QConvertError) as info:
        detect_format(path)
    return str(info.value)


def test_a_gguf_file_is_detected_by_its_magic_not_its_name(tmp_path):
    assert detect_format(write_gguf(tmp_path / "model.gguf")) == "gguf"
    assert detect_format(write_gguf(tmp_path / "weights.bin")) == "gguf"


def test_a_dense_safetensors_folder_with_a_config_is_hf(tmp_path):
    assert detect_format(write_dense_hf(tmp_path / "model")) == "hf"


def test_a_specific_format_beats_the_generic_hf(tmp_path):
    folder = write_dense_hf(tmp_path / "model")
    with scratch_registry():
        register_format(FormatEntry("test-claims-all", sniff=lambda path: True))
        assert detect_format(folder) == "test-claims-all"


def test_an_empty_folder_is_refused_saying_what_it_holds(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert detect_refusal(folder) == (
        f"{folder}: not a format qconvert reads: a folder without config.json (empty); "
        f"qconvert reads {readable_formats()}")


@pytest.mark.parametrize("make, holds", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"), (p / "w.bin").write_bytes(b"x")),
     "a folder without config.json (files: .bin, .txt)"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{}")),
     "a folder with a config.json but no .safetensors weights"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{not json")),
     "a folder whose config.json is not valid JSON"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "eetq", "format": "w8a16"}}))),
     "a checkpoint folder with quant_method 'eetq', format 'w8a16', which qconvert does not read yet"),
    (lambda p: p.write_bytes(b""), "an empty file"),
    (lambda p: p.write_bytes(b"PK\x03\x04rest"), "a zip archive (a torch.save file?)"),
    (lambda p: p.write_bytes(bytes(range(16))), "a file starting with bytes 0001020304050607"),
])
def test_what_no_format_claims_is_described_from_its_data(tmp_path, make, holds):
    path = tmp_path / "input"
    make(path)
    assert detect_refusal(path) == f"{path}: not a format qconvert reads: {holds}; qconvert reads {readable_formats()}"


def test_a_missing_path_is_refused(tmp_path):
    assert detect_refusal(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'}: no such file or directory"


def test_a_refused_registration_leaves_the_registry_as_it_was():
    from qconvert.converters import registry as R

    R.all_formats()
    before_formats, before_aliases = dict(R._REGISTRY), dict(R._ALIASES)
    try:
        with pytest.raises(ValueError, match="already names format 'gguf'"):
            R.register_format(R.FormatEntry("brand-new", aliases=("fresh-alias", "llama.cpp")))
        with pytest.raises(ValueError, match="is the name of format 'hqq'"):
            R.register_format(R.FormatEntry("other-new", aliases=("hqq",)))
        assert R._REGISTRY == before_formats and R._ALIASES == before_aliases
    finally:
        R._REGISTRY.clear(), R._REGISTRY.update(before_formats)
        R._ALIASES.clear(), R._ALIASES.update(before_aliases)
