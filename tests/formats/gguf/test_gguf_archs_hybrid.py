"""GGUF for the hybrid linear-attention families (issue 26): Qwen3.5 (qwen35), Qwen3.5-MoE (qwen35moe: every
layer routed, 4 experts top 2, a gated shared expert) and Qwen3-Next (qwen3next: the same with its linear
attention's projections fused, in_proj_qkvz split into attn_qkv / attn_gate and merged back), judged by llama.cpp itself on a
tiny random model with the real layer mix (three Gated-DeltaNet layers, then a full-attention one; 2 key and 4
value heads so that the value heads are reordered as on the released models; an MTP block beside the layers):

- `hf->gguf --type f32` writes every tensor (name, type, bytes) and every `qwen35.*` key that llama.cpp's own
  converter writes by default (the MTP block kept as the block after the trunk: blk.4.nextn.*, block_count 5,
  nextn_predict_layers 1), and with `--no-mtp` what it writes with --no-mtp (the block left out); llama.cpp's
  logits on the four files are identical; they follow transformers' within 1e-4;
- `--type q8_0` and `--type q4_k_m` (256 wide: K types) equal llama-quantize's bytes of our F32 file;
- `gguf->hf` loads in transformers as Qwen3_5ForCausalLM with the source's logits (1e-4), the MTP block back
  under its `mtp.*` names with the source's values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import fixtures_archs
from gguf_arch_files import ROOT, cached as _cached, converter, model_keys as _model_keys, same_tensors
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

KINDS = fixtures_archs.HYBRID_KINDS
PROMPT = fixtures_archs.arch_prompt()
CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
ARCHS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}


def model_dir(kind: str, wide: bool = False) -> Path:
    name = f"hybrid-{kind}" + ("-wide" if wide else "")
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, kind, wide=wide))


def ours_f32(kind: str, wide: bool = False) -> Path:
    """Our F32 file of the kind's folder, its MTP block kept (the default)."""
    src = model_dir(kind, wide)
    return _cached(src.with_name(src.name + "-f32-mtp.gguf"),
                   lambda out: run_cli("hf->gguf", src, out, "--type", "f32"))


def _reference_path(kind: str, mtp: bool) -> Path:
    return ROOT / f"hybrid-{kind}-ref{'-mtp' if mtp else ''}.gguf"


def reference_f32(kind: str, mtp: bool = True) -> Path:
    """llama.cpp's converter's file of the kind's folder: by default (the MTP block kept), or with --no-mtp. The
    first call converts every such file not cached yet in one child process (torch imported once)."""
    ref = converter()
    path = _reference_path(kind, mtp)
    if not path.with_name(path.name + ".done").exists():
        todo = [(k, m) for k in KINDS for m in (True, False)
                if not _reference_path(k, m).with_name(_reference_path(k, m).name + ".done").exists()]
        jobs = [(model_dir(k), _reference_path(k, m), f"tiny {k}", () if m else ("--no-mtp",)) for k, m in todo]
        for _, out, _, _ in jobs:
            out.unlink(missing_ok=True)
        ref.convert_references(jobs)
        for _, out, _, _ in jobs:
            out.with_name(out.name + ".done").write_text("ok")
    return path


def _same_tensors(ours: Path, theirs: Path, exact_dims: bool = True) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type, shape and bytes; -> the types present.
    `exact_dims` False: shapes compared as ggml_n_dims counts them (llama-quantize's output)."""
    return same_tensors(ours, theirs, trim_dims=not exact_dims)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_is_what_llama_cpp_converter_writes_and_runs(kind, tmp_path):
    report = tmp_path / "report.json"
    ours = tmp_path / "ours.gguf"
    run_cli("hf->gguf", model_dir(kind), ours, "--type", "f32", "--report", report)
    theirs = reference_f32(kind)
    assert _same_tensors(ours, theirs) == {"F32"}
    assert _model_keys(ours) == _model_keys(theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == ARCHS[kind]
    names = set(gguf_tensors(ours))
    # both kinds of layer are there: Gated DeltaNet (A, conv, tiled heads) and gated full attention
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_conv1d.weight", "blk.0.attn_qkv.weight",
            "blk.0.ssm_norm.weight", "blk.3.attn_q.weight", "blk.3.attn_q_norm.weight"} <= names
    if kind != "qwen3_5":  # routed and shared experts in every layer, no dense FFN
        assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp_shexp.weight",
                "blk.3.ffn_down_shexp.weight"} <= names and not any(".ffn_gate.weight" in n for n in names)
    # the MTP block is the block after the trunk: a full-attention layer and its own tensors
    fields = gguf.GGUFReader(str(ours)).fields
    assert fields[f"{ARCHS[kind]}.block_count"].contents() == 5
    assert fields[f"{ARCHS[kind]}.nextn_predict_layers"].contents() == 1
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
            "blk.4.nextn.shared_head_norm.weight", "blk.4.attn_q.weight"} <= names
    results = {t["name"]: t for t in json.loads(report.read_text())["tensors"]}
    # A = -exp(A_log) may round: said so, and measured after the log (exact where it happens not to round)
    assert "-exp(A_log)" in results["model.layers.0.linear_attn.A_log"]["reason"]
    assert all(t["verdict"] in ("exact", "near-exact") and t["max_abs_err"] < 1e-6 for t in results.values())

    # --no-mtp: what the converter writes with --no-mtp (the block and its keys left out, dropped with a note)
    trunk, trunk_report = tmp_path / "ours-no-mtp.gguf", tmp_path / "report-no-mtp.json"
    run_cli("hf->gguf", model_dir(kind), trunk, "--type", "f32", "--no-mtp", "--report", trunk_report)
    theirs_trunk = reference_f32(kind, mtp=False)
    assert _same_tensors(trunk, theirs_trunk) == {"F32"}
    assert _model_keys(trunk) == _model_keys(theirs_trunk)
    assert not any(n.startswith("blk.4.") for n in gguf_tensors(trunk))
    planned = json.loads(trunk_report.read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    assert dropped and dropped == {t["name"] for t in planned if t["name"].startswith("mtp.")}

    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))  # the same file to llama.cpp
    # llama.cpp runs the trunk alone (the MTP block serves its draft context only): the same logits without it
    assert np.array_equal(got, llama_logits(trunk, PROMPT))
    assert np.array_equal(got, llama_logits(theirs_trunk, PROMPT))
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())  # measured 6e-6
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset, ftype, wide", [("q8_0", 7, False), ("q4_k_m", 15, True)])
def test_quantized_equals_llama_quantize(kind, preset, ftype, wide, tmp_path):
    """llama-quantize's per-tensor types and bytes on the hybrid layers (the SSM tensors kept F32, the
    Q4_K_M mix's Q6_K choices), from our F32 file; 256 wide for the K types."""
    f32 = ours_f32(kind, wide)
    ours = tmp_path / f"ours-{preset}.gguf"
    run_cli("hf->gguf", model_dir(kind, wide), ours, "--type", preset, "--allow-requant")
    theirs = llama_quantize(f32, tmp_path / f"llama-{preset}.gguf", ftype)
    types = _same_tensors(ours, theirs, exact_dims=False)
    assert ({"Q8_0"} if preset == "q8_0" else {"Q4_K", "Q6_K"}) <= types
    a = gguf_tensors(ours)
    assert all(a[n].tensor_type.name == "F32" for n in a if n.endswith((".ssm_a", ".ssm_conv1d.weight", ".ssm_dt.bias",
                                                                        "ffn_gate_inp.weight", "gate_inp_shexp.weight")))
    if preset == "q8_0":
        assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_to_hf_gives_back_the_source_class(kind, tmp_path):
    out = tmp_path / "hf"
    run_cli("gguf->hf", ours_f32(kind), out, "--type", "f32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[kind]]
    source = json.loads((model_dir(kind) / "config.json").read_text())
    for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim"):
        assert config[key] == source[key], key
    assert config.get("mtp_num_hidden_layers") == source.get("mtp_num_hidden_layers")
    got = fixtures_archs.transformers_logits(out, PROMPT)
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())
    # the MTP block is back where the source had it (mtp.*), with the source's values (its norms stored as
    # 1 + w: within float32's rounding of that addition)
    from safetensors.torch import load_file

    back, src = load_file(str(out / "model.safetensors")), load_file(str(model_dir(kind) / "model.safetensors"))
    mtp = {n for n in src if n.startswith("mtp.")}
    assert mtp and mtp == {n for n in back if n.startswith("mtp.")}
    assert max(float((back[n] - src[n]).abs().max()) for n in mtp) < 1e-6


def test_linear_heads_that_do_not_divide_are_refused(tmp_path):
    """A config whose value heads are not a multiple of its key heads: one line naming config.json, exit 2,
    nothing written."""
    src = tmp_path / "bad"
    shutil.copytree(model_dir("qwen3_5"), src)
    config = json.loads((src / "config.json").read_text())
    config["linear_num_value_heads"] = 3
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32", check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "linear_num_value_heads 3" in lines[0] and "config.json" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
