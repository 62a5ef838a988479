"""GGUF for the giant MoE families of issue 26, judged by llama.cpp itself (the llama-cpp-python sdist's
convert_hf_to_gguf.py and llama_model_quantize, and its runtime):

- glm_moe_dsa (GLM-5, llama.cpp's `glm-dsa`): MLA with a q LoRA, a dense lead layer, routed + shared experts
  with DeepSeek's sigmoid router, and the DSA indexer (64 heads, top-k 8 < the 16-token prompt; the last of 3
  layers "shared", without indexer tensors). `hf->gguf --type f32` is llama.cpp's converter's file: every
  tensor's name, type and bytes, every `glm-dsa.*` key (the indexer's per-layer types included, a key the
  installed gguf 0.19 does not name), and llama.cpp gives the same logits on both, within 1e-4 of
  transformers'; `--type q8_0` / `--type q4_k_m` are llama-quantize's bytes of our F32 file; `gguf->hf` loads
  in transformers as GlmMoeDsaForCausalLM with the source's logits.
- DeepSeek-V4 (llama.cpp's deepseek4, absent from the installed gguf 0.19) is refused in one line that says so
  and names llama.cpp's converter (Kimi-K3, absent too, is written: test_gguf_archs_kimik3.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")



def _archs_module():
    """test_gguf_archs.py beside this file, by path (pytest runs with --import-mode=importlib): its fixture
    cache, the reference converter and the file comparisons are shared, not copied."""
    import importlib.util
    import sys

    name = "qconvert_test_gguf_archs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_gguf_archs.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_archs = _archs_module()
ROOT, _assert_same_model_keys, _cached = _archs.ROOT, _archs._assert_same_model_keys, _archs._cached
_reference_module, _same_tensors = _archs._reference_module, _archs._same_tensors

PROMPT = fixtures_archs.arch_prompt()
GLM = "glm_moe_dsa"


def glm_dir(wide: bool = False) -> Path:
    name = f"giant-{GLM}" + ("-wide" if wide else "")
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, GLM, layers=3, wide=wide))


def glm_f32() -> Path:
    src = glm_dir()
    return _cached(ROOT / f"giant-{GLM}-f32.gguf", lambda out: run_cli("hf->gguf", src, out, "--type", "f32"))


def glm_reference() -> Path:
    ref = _reference_module()
    try:
        ref.llama_cpp_src()
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's converter is not extracted: {e}")  # a failure under QCONVERT_REQUIRE_ORACLES
    src = glm_dir()
    return _cached(ROOT / f"giant-{GLM}-ref.gguf", lambda out: ref.convert_reference(src, out, model_name="tiny glm"))


def test_glm_dsa_f32_is_what_llama_cpp_converter_writes_and_runs():
    ours, theirs = glm_f32(), glm_reference()
    assert _same_tensors(ours, theirs) == {"F32"}
    _assert_same_model_keys(ours, theirs)
    a = gguf_tensors(ours)
    # the indexer in the "full" layers only, the dense lead layer without experts
    indexer = {n for n in a if ".indexer." in n}
    assert {n.split(".")[1] for n in indexer} == {"0", "1"} and len(indexer) == 2 * 5
    assert "blk.0.ffn_gate.weight" in a and "blk.0.ffn_gate_exps.weight" not in a
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight", "blk.1.exp_probs_b.bias",
            "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= set(a)
    fields, theirs_fields = gguf.GGUFReader(str(ours)).fields, gguf.GGUFReader(str(theirs)).fields
    assert list(fields["glm-dsa.attention.indexer.types"].contents()) == [True, True, False]
    # GLM's special tokens found by their text, as the converter finds them (eot <|user|>, eom <|observation|>)
    for typ in ("bos", "eos", "eot", "eom", "unknown"):
        key = f"tokenizer.ggml.{typ}_token_id"
        assert fields[key].contents() == theirs_fields[key].contents(), key
    assert fields["tokenizer.ggml.eot_token_id"].contents() == 509

    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    want = fixtures_archs.transformers_logits(glm_dir(), PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())  # measured 4e-5
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show


def test_glm_dsa_indexer_changes_the_logits(tmp_path):
    """The indexer's top-k (8 of 16 tokens) is what llama.cpp runs: the same file with top_k raised to the
    whole prompt (every token kept) gives other logits, so the agreement above covers the indexer."""
    src = tmp_path / "topk16"
    import shutil

    shutil.copytree(glm_dir(), src)
    config = json.loads((src / "config.json").read_text())
    config["index_topk"] = 16
    (src / "config.json").write_text(json.dumps(config, indent=2))
    out = tmp_path / "topk16.gguf"
    run_cli("hf->gguf", src, out, "--type", "f32")
    assert np.abs(llama_logits(out, PROMPT) - llama_logits(glm_f32(), PROMPT)).max() > 0.05


def test_glm_dsa_q8_0_equals_llama_quantize(tmp_path):
    ours = tmp_path / "ours-q8_0.gguf"
    run_cli("hf->gguf", glm_dir(), ours, "--type", "q8_0", "--allow-requant")
    theirs = llama_quantize(glm_f32(), tmp_path / "llama-q8_0.gguf", 7)
    assert "Q8_0" in _same_tensors(ours, theirs)
    a = gguf_tensors(ours)
    assert all(a[n].tensor_type.name == "F32" for n in a if n.endswith("ffn_gate_inp.weight"))
    assert all(a[n].tensor_type.name == "Q8_0" for n in a if n.endswith("_exps.weight"))
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


def test_glm_dsa_q4_k_m_equals_llama_quantize(tmp_path):
    src = glm_dir(wide=True)
    f32 = tmp_path / "f32.gguf"
    run_cli("hf->gguf", src, f32, "--type", "f32")
    ours = tmp_path / "ours-q4_k_m.gguf"
    run_cli("hf->gguf", src, ours, "--type", "q4_k_m", "--allow-requant")
    theirs = llama_quantize(f32, tmp_path / "llama-q4_k_m.gguf", 15)
    assert {"Q4_K", "Q6_K"} <= _same_tensors(ours, theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == 15


def test_glm_dsa_gguf_to_hf_gives_back_the_source_class(tmp_path):
    out = tmp_path / "hf"
    run_cli("gguf->hf", glm_f32(), out, "--type", "f32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["indexer_types"] == ["full", "full", "shared"] and config["index_n_heads"] == 64
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    got = fixtures_archs.transformers_logits(out, PROMPT)
    want = fixtures_archs.transformers_logits(glm_dir(), PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())


def test_glm_dsa_indexer_heads_not_a_multiple_of_64_are_refused(tmp_path):
    import shutil

    src = tmp_path / "heads32"
    shutil.copytree(glm_dir(), src)
    config = json.loads((src / "config.json").read_text())
    config["index_n_heads"] = 32
    (src / "config.json").write_text(json.dumps(config, indent=2))
    out = tmp_path / "bad.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32", check_rc=2)
    assert "index_n_heads 32 is not a multiple of 64" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


# (Kimi-K3, which gguf 0.19 does not name either, is written: tests/formats/gguf/test_gguf_archs_kimik3.py)
@pytest.mark.parametrize("hf_class,gguf_name", [("DeepseekV4ForCausalLM", "deepseek4")])
def test_giants_gguf_0_19_does_not_name_are_refused_saying_why(hf_class, gguf_name, tmp_path):
    """DeepSeek-V4 is a llama.cpp architecture the installed gguf 0.19 does not name (and qconvert
    does not write): one line naming the class, llama.cpp's name for it and the converter to use, exit 2,
    nothing written."""
    from safetensors.torch import save_file

    assert gguf_name not in gguf.MODEL_ARCH_NAMES.values()
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((glm_dir() / "config.json").read_text())
    config.update(architectures=[hf_class])
    (src / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(512, 128)}, str(src / "model.safetensors"))
    out = tmp_path / "out.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32", check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and hf_class in lines[0] and f"llama.cpp's {gguf_name}" in lines[0]
    assert "convert_hf_to_gguf.py" in lines[0] and not out.exists()
