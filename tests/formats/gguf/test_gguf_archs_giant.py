"""GGUF for the giant MoE families of issue 26, judged by llama.cpp itself (the llama-cpp-python sdist's
convert_hf_to_gguf.py and llama_model_quantize, and its runtime):

- glm_moe_dsa (GLM-5, llama.cpp's `glm-dsa`): MLA with a q LoRA, a dense lead layer, routed + shared experts
  with DeepSeek's sigmoid router, and the DSA indexer (64 heads, top-k 8 < the 16-token prompt; the last of 3
  layers "shared", without indexer tensors). `hf->gguf --type f32` is llama.cpp's converter's file: every
  tensor's name, type and bytes, every `glm-dsa.*` key (the indexer's per-layer types included, a key the
  installed gguf 0.19 does not name), and llama.cpp gives the same logits on both, within 1e-4 of
  transformers'; `--type q8_0` / `--type q4_k_m` are llama-quantize's bytes of our F32 file; `gguf->hf` loads
  in transformers as GlmMoeDsaForCausalLM with the source's logits. Its multi-token-prediction layer
  (model.layers.3, with the indexer, routed experts and eh_proj / enorm / hnorm / shared_head / embed_tokens) is
  kept as the converter keeps it by default (blk.3.*, block_count 4, nextn_predict_layers 1), left out with
  `--no-mtp` as its --no-mtp leaves it (bytes and keys equal, the same logits), and comes back from `gguf->hf`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from gguf_arch_files import (ROOT, assert_same_model_keys as _assert_same_model_keys, cached as _cached, converter,
                             same_tensors)
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")



def _same_tensors(ours: Path, theirs: Path) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type and bytes; -> the types present."""
    return same_tensors(ours, theirs, shapes=False)


PROMPT = fixtures_archs.arch_prompt()
GLM = "glm_moe_dsa"


def glm_dir(wide: bool = False) -> Path:
    # "-mtp": the fixture gained its MTP layer (fixtures_archs._glm_mtp_layer); an older cache is not taken for it
    name = f"giant-{GLM}-mtp" + ("-wide" if wide else "")
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, GLM, layers=3, wide=wide))


def glm_f32() -> Path:
    src = glm_dir()
    return _cached(ROOT / f"{src.name}-f32.gguf", lambda out: run_cli("hf->gguf", src, out, "--type", "f32"))


def glm_reference(mtp: bool = True) -> Path:
    """llama.cpp's converter's file of the GLM-5 folder, by default or with its --no-mtp (both made by the first
    call, in one child process)."""
    ref = converter()
    src = glm_dir()
    paths = {m: ROOT / f"{src.name}-ref{'' if m else '-no-mtp'}.gguf" for m in (True, False)}
    if not all(p.with_name(p.name + ".done").exists() for p in paths.values()):
        for p in paths.values():
            p.unlink(missing_ok=True)
        ref.convert_references([(src, paths[m], "tiny glm", () if m else ("--no-mtp",)) for m in (True, False)])
        for p in paths.values():
            p.with_name(p.name + ".done").write_text("ok")
    return paths[mtp]


def test_glm_dsa_f32_is_what_llama_cpp_converter_writes_and_runs():
    ours, theirs = glm_f32(), glm_reference()
    assert _same_tensors(ours, theirs) == {"F32"}
    _assert_same_model_keys(ours, theirs)
    a = gguf_tensors(ours)
    # the indexer in the "full" layers only (and in the MTP layer, which has its own), the dense lead layer without
    # experts
    indexer = {n for n in a if ".indexer." in n}
    assert {n.split(".")[1] for n in indexer} == {"0", "1", "3"} and len(indexer) == 3 * 5
    # the MTP layer, kept as the block after the trunk
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
            "blk.3.nextn.shared_head_norm.weight", "blk.3.nextn.shared_head_head.weight",
            "blk.3.nextn.embed_tokens.weight", "blk.3.attn_k_b.weight", "blk.3.ffn_gate_exps.weight"} <= set(a)
    assert "blk.0.ffn_gate.weight" in a and "blk.0.ffn_gate_exps.weight" not in a
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight", "blk.1.exp_probs_b.bias",
            "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= set(a)
    fields, theirs_fields = gguf.GGUFReader(str(ours)).fields, gguf.GGUFReader(str(theirs)).fields
    assert list(fields["glm-dsa.attention.indexer.types"].contents()) == [True, True, False]
    assert fields["glm-dsa.block_count"].contents() == 4 and fields["glm-dsa.nextn_predict_layers"].contents() == 1
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


def test_glm_dsa_no_mtp_is_what_llama_cpp_converter_writes_with_no_mtp(tmp_path):
    """`--no-mtp` leaves GLM-5's MTP layer out as the converter's --no-mtp does (block_count 3, no
    nextn_predict_layers, no blk.3.*), its tensors dropped with a note; llama.cpp runs the same trunk."""
    out, report = tmp_path / "no-mtp.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", glm_dir(), out, "--type", "f32", "--no-mtp", "--report", report)
    theirs = glm_reference(mtp=False)
    assert _same_tensors(out, theirs) == {"F32"}
    _assert_same_model_keys(out, theirs)
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["glm-dsa.block_count"].contents() == 3 and "glm-dsa.nextn_predict_layers" not in fields
    planned = json.loads(report.read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    assert dropped and dropped == {t["name"] for t in planned if t["name"].startswith("model.layers.3.")}
    got = llama_logits(out, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    assert np.array_equal(got, llama_logits(glm_f32(), PROMPT))


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
    # the MTP layer is back where the source had it (model.layers.3), kv_b_proj merged back from its halves
    from safetensors.torch import load_file

    back, src = load_file(str(out / "model.safetensors")), load_file(str(glm_dir() / "model.safetensors"))
    mtp = {n for n in src if n.startswith("model.layers.3.")}
    assert mtp and mtp == {n for n in back if n.startswith("model.layers.3.")}
    assert all(torch.equal(back[n], src[n]) for n in mtp)
    assert config["num_nextn_predict_layers"] == 1


def test_glm_dsa_indexer_heads_not_a_multiple_of_64_are_refused(tmp_path):
    import shutil

    src = tmp_path / "heads32"
    shutil.copytree(glm_dir(), src)
    config = json.loads((src / "config.json").read_text())
    config["index_n_heads"] = 32
    (src / "config.json").write_text(json.dumps(config, indent=2))
    # a model that has 32 indexer heads (its tensors agree with the config, or transformers' class refuses the
    # shapes first): the per-head rows of every indexer cut to 32 heads
    from helpers import edit_safetensors

    def cut(tensors):
        for name in list(tensors):
            if name.endswith(("indexer.weights_proj.weight", "indexer.wq_b.weight")):
                tensors[name] = tensors[name][: tensors[name].shape[0] // 2].clone()

    edit_safetensors(src / "model.safetensors", cut)
    out = tmp_path / "bad.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32", check_rc=2)
    assert "index_n_heads 32 is not a multiple of 64" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


