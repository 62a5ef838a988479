"""GGUF for the issue-26 architectures of the arch-std entries (formats/gguf/archs/mistral3.py, smollm.py, ...),
judged by llama.cpp itself on a tiny random model of each (tests/support/fixtures_archs.py, STD_KINDS):

- `hf->gguf --type f32` is what llama.cpp's own convert_hf_to_gguf.py writes for the same folder: every
  tensor's name, type and bytes, every `{arch}.*` key; llama.cpp's logits on our file equal those on the
  converter's file exactly, and follow transformers' (1e-4);
- the architecture's quirk is exercised: without it transformers' logits move by far more than that
  (Ministral 3's attention temperature, SmolLM3's and Llama 4's NoPE layers, OLMo 3's sliding windows,
  GLM-4.5's routed scaling factor, MiniMax-M2's partial rope, ERNIE 4.5's dense lead layer);
- `--type q8_0` and `--type q4_k_m` (256 wide, so the K types apply) equal llama-quantize's bytes of our F32 file;
- `gguf->hf --type f32` loads in transformers as the source's class, with the source's logits exactly;
- Llama4ForConditionalGeneration (the released Llama 4 checkpoints' class, a vision tower beside the text model)
  is written as its text model, the tower left out as the converter leaves it: its file byte for byte, llama.cpp's
  logits on the two the same and within 1e-4 of transformers' text model, and `gguf->hf` gives that text model
  (Llama4ForCausalLM) with its logits exactly;
- GLM-4.5's multi-token-prediction layer (model.layers.3, as its checkpoints carry one) is kept as llama.cpp's
  converter keeps it by default (blk.3.* with blk.3.nextn.*, block_count 4) and left out with `--no-mtp` as the
  converter's --no-mtp leaves it (bytes and keys equal both ways, llama.cpp's logits the same on all four
  files), and comes back from `gguf->hf` where the source had it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from gguf_arch_files import ROOT, cached as _cached, converter, model_keys as _model_keys, same_tensors
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

KINDS = fixtures_archs.STD_KINDS
PROMPT = fixtures_archs.arch_prompt()
CLASSES = {"mistral3": "Ministral3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmo3": "Olmo3ForCausalLM",
           "olmo2": "Olmo2ForCausalLM", "exaone4": "Exaone4ForCausalLM", "llama4": "Llama4ForCausalLM",
           "glm4_moe": "Glm4MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
           "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
ARCHS = {"mistral3": "mistral3", "smollm3": "smollm3", "olmo3": "olmo2", "olmo2": "olmo2", "exaone4": "exaone4",
         "llama4": "llama4", "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "ernie4_5_moe": "ernie4_5-moe"}
MOE_KINDS = ("llama4", "glm4_moe", "minimax_m2", "ernie4_5_moe")
# kinds whose checkpoint carries an MTP block llama.cpp's converter keeps by default (fixtures_archs._glm_mtp_layer)
MTP_KINDS = ("glm4_moe",)
# kinds whose fixture changed since a cache of it may have been built (GLM-4.5's gained its MTP layer): their
# cache names say so, so that an older cache is never taken for them
CACHE_TAG = {"glm4_moe": "-mtp"}
# kinds converted with the others but tested on their own: Llama 4's released (multimodal) class
OTHER_KINDS = ("llama4_vl",)
# keys that carry each kind's quirk: they must be in both files (and equal, as every key is)
QUIRK_KEYS = {"mistral3": {"mistral3.attention.temperature_scale", "mistral3.rope.scaling.yarn_log_multiplier",
                           "mistral3.rope.scaling.type"},
              "smollm3": set(),
              "olmo3": {"olmo2.attention.sliding_window", "olmo2.attention.sliding_window_pattern"},
              "olmo2": set(), "exaone4": set(),
              "llama4": {"llama4.interleave_moe_layer_step", "llama4.expert_feed_forward_length"},
              "glm4_moe": {"glm4moe.leading_dense_block_count", "glm4moe.expert_shared_count",
                           "glm4moe.expert_weights_scale", "glm4moe.nextn_predict_layers", "glm4moe.expert_gating_func",
                           "glm4moe.rope.dimension_count"},
              "minimax_m2": {"minimax-m2.expert_gating_func", "minimax-m2.rope.dimension_count"},
              "ernie4_5_moe": {"ernie4_5-moe.leading_dense_block_count", "ernie4_5-moe.expert_shared_feed_forward_length",
                               "ernie4_5-moe.interleave_moe_layer_step"}}


def _stem(kind: str) -> str:
    return f"std-{kind}{CACHE_TAG.get(kind, '')}"


def model_dir(kind: str, wide: bool = False) -> Path:
    name = _stem(kind) + ("-wide" if wide else "")
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, kind, wide=wide))


def ours_f32(kind: str, wide: bool = False) -> Path:
    src = model_dir(kind, wide)
    return _cached(ROOT / f"{src.name}-f32.gguf", lambda out: run_cli("hf->gguf", src, out, "--type", "f32"))


def _reference_path(kind: str, mtp: bool = True) -> Path:
    return ROOT / f"{_stem(kind)}-ref{'' if mtp else '-no-mtp'}.gguf"


def reference_f32(kind: str, mtp: bool = True) -> Path:
    """llama.cpp's converter's file of the kind's folder (`mtp` False: with its --no-mtp, for MTP_KINDS). The first
    call converts every file not cached yet in one child process (the converter and torch imported once, not once
    per kind)."""
    ref = converter()
    path = _reference_path(kind, mtp)
    done = path.with_name(path.name + ".done")
    if not done.exists():
        wanted = [(k, True) for k in KINDS + OTHER_KINDS] + [(k, False) for k in MTP_KINDS]
        todo = [(k, m) for k, m in wanted if not _reference_path(k, m).with_name(_reference_path(k, m).name + ".done").exists()]
        jobs = [(model_dir(k), _reference_path(k, m), "tiny " + k, () if m else ("--no-mtp",)) for k, m in todo]
        for _, out, _, _ in jobs:
            out.unlink(missing_ok=True)
        ref.convert_references(jobs)
        for _, out, _, _ in jobs:
            out.with_name(out.name + ".done").write_text("ok")
    return path


def _same_tensors(ours: Path, theirs: Path, quantized: bool = False) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type, shape and bytes; -> the types present.
    `quantized`: `theirs` is llama-quantize's, which drops trailing unit dimensions from the header (ERNIE's
    [1, experts] exp_probs_b.bias: ne [experts, 1] in the converter's file and ours, [experts] in its); the
    bytes are the same."""
    return same_tensors(ours, theirs, trim_dims=quantized)


def _logits_without_quirk(kind: str) -> np.ndarray | None:
    """transformers' logits of the same weights with the kind's quirk switched off (None: no switch)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir(kind)))
    if kind == "mistral3":
        cfg.rope_parameters = {**cfg.rope_parameters, "llama_4_scaling_beta": 0.0}
    elif kind == "smollm3":
        cfg.no_rope_layers = [1] * cfg.num_hidden_layers
    elif kind == "olmo3":
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    elif kind == "llama4":  # its NoPE layer
        cfg.no_rope_layers = [1] * cfg.num_hidden_layers
    elif kind == "glm4_moe":  # the routed experts' scale (expert_weights_scale)
        cfg.routed_scaling_factor = 1.0
    elif kind == "minimax_m2":  # its partial rope (rope.dimension_count)
        cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 1.0}
    elif kind == "ernie4_5_moe":  # its dense lead layer (leading_dense_block_count)
        cfg.moe_layer_start_index = 0
    else:  # OLMo 2's and EXAONE 4's quirks are their post-norms and q/k norms: the weights themselves
        return None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(kind)), config=cfg, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_f32_is_what_llama_cpp_converter_writes_and_runs(kind):
    ours, theirs = ours_f32(kind), reference_f32(kind)
    assert _same_tensors(ours, theirs) == {"F32"}
    ka, kb = _model_keys(ours), _model_keys(theirs)
    assert ka == kb
    assert QUIRK_KEYS[kind] <= set(ka)
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == ARCHS[kind]
    stacks = [n for n in gguf_tensors(ours) if n.endswith("_exps.weight")]
    assert bool(stacks) == (kind in MOE_KINDS)
    if kind in MTP_KINDS:  # the MTP layer kept as the block after the trunk, with its own tensors
        fields, names = gguf.GGUFReader(str(ours)).fields, set(gguf_tensors(ours))
        assert fields[f"{ARCHS[kind]}.block_count"].contents() == 4
        assert fields[f"{ARCHS[kind]}.nextn_predict_layers"].contents() == 1
        assert {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
                "blk.3.nextn.shared_head_norm.weight", "blk.3.nextn.shared_head_head.weight",
                "blk.3.nextn.embed_tokens.weight", "blk.3.ffn_gate_exps.weight", "blk.3.attn_q.weight"} <= names

    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show
    # the quirk is exercised: the same weights without it are far from what llama.cpp computes
    other = _logits_without_quirk(kind)
    assert other is None or np.abs(other - want).max() > 0.05


# OLMo 2 is OLMo 3's architecture without windows: llama-quantize treats its tensors alike, so it is quantized once
QUANT_KINDS = tuple(k for k in KINDS if k != "olmo2")


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_q8_0_equals_llama_quantize(kind, tmp_path):
    ours = tmp_path / "ours-q8_0.gguf"
    run_cli("hf->gguf", model_dir(kind), ours, "--type", "q8_0", "--allow-requant")
    theirs = llama_quantize(ours_f32(kind), tmp_path / "llama-q8_0.gguf", 7)
    assert "Q8_0" in _same_tensors(ours, theirs, quantized=True)
    if kind in MOE_KINDS:  # routers stay F32, the expert stacks quantized
        a = gguf_tensors(ours)
        assert all(a[n].tensor_type.name == "F32" for n in a if n.endswith("ffn_gate_inp.weight"))
        assert all(a[n].tensor_type.name == "Q8_0" for n in a if n.endswith("_exps.weight"))
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_q4_k_m_equals_llama_quantize(kind, tmp_path):
    ours = tmp_path / "ours-q4_k_m.gguf"
    run_cli("hf->gguf", model_dir(kind, wide=True), ours, "--type", "q4_k_m", "--allow-requant")
    theirs = llama_quantize(ours_f32(kind, wide=True), tmp_path / "llama-q4_k_m.gguf", 15)
    assert {"Q4_K", "Q6_K"} <= _same_tensors(ours, theirs, quantized=True)
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == 15


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_to_hf_gives_back_the_source_class(kind, tmp_path):
    out = tmp_path / "hf"
    run_cli("gguf->hf", ours_f32(kind), out, "--type", "f32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[kind]]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == CLASSES[kind]
    got = fixtures_archs.transformers_logits(out, PROMPT)
    want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    if kind in MTP_KINDS:  # the MTP layer is back where the source had it, with its values
        from safetensors.torch import load_file

        back, src = load_file(str(out / "model.safetensors")), load_file(str(model_dir(kind) / "model.safetensors"))
        mtp = {n for n in src if n.startswith("model.layers.3.")}
        assert mtp and mtp == {n for n in back if n.startswith("model.layers.3.")}
        assert all(torch.equal(back[n], src[n]) for n in mtp)
        assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_no_mtp_is_what_llama_cpp_converter_writes_with_no_mtp(kind, tmp_path):
    """`--no-mtp` leaves the MTP layer out as the converter's --no-mtp does (no tensor of it, block_count the
    trunk's, no nextn_predict_layers), each of its tensors dropped with a note; llama.cpp runs the trunk alone
    either way, so the logits are those of the file that keeps it."""
    out, report = tmp_path / "no-mtp.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", model_dir(kind), out, "--type", "f32", "--no-mtp", "--report", report)
    theirs = reference_f32(kind, mtp=False)
    assert _same_tensors(out, theirs) == {"F32"}
    keys = _model_keys(out)
    assert keys == _model_keys(theirs)
    assert keys[f"{ARCHS[kind]}.block_count"] == 3 and f"{ARCHS[kind]}.nextn_predict_layers" not in keys
    planned = json.loads(report.read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    assert dropped and dropped == {t["name"] for t in planned if t["name"].startswith("model.layers.3.")}
    got = llama_logits(out, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    assert np.array_equal(got, llama_logits(ours_f32(kind), PROMPT))


# configs llama.cpp's graph cannot honour: (kind, config change, words of the one-line warning)
CAVEATS = [
    ("smollm3", {"no_rope_layers": [1, 0, 1, 1]}, "no_rope_layers [1, 0, 1, 1] is not every 4th layer"),
    ("exaone4", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
     "sliding windows only in 64-layer models"),
    ("mistral3", {"rope_parameters": {"mscale": 2.0}}, "mscale 2.0 is not 1"),
    ("llama4", {"attention_chunk_size": 4096}, "attention_chunk_size 4096 is not 8192"),
    ("glm4_moe", {"n_group": 2, "topk_group": 1}, "without group pruning"),
]


@pytest.mark.parametrize("kind, change, words", CAVEATS, ids=[c[0] for c in CAVEATS])
def test_what_llama_cpp_cannot_honour_is_named(kind, change, words, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(model_dir(kind), src)
    config = json.loads((src / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32")
    assert words in proc.stderr
    assert _same_tensors(out, ours_f32(kind)) == {"F32"}  # the same tensors: only llama.cpp's run differs


def test_ernie_mtp_block_is_dropped_as_the_converter_skips_it(tmp_path):
    """ERNIE 4.5's checkpoints carry a multi-token-prediction block outside model.layers (model.mtp_*), which
    llama.cpp's converter skips: dropped with a note, the GGUF the same as without it."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(model_dir("ernie4_5_moe"), src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({"model.mtp_emb_norm.0.weight": torch.ones(128), "model.mtp_hidden_norm.0.weight": torch.ones(128),
                    "model.mtp_linear_proj.0.weight": torch.zeros(128, 256),
                    "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(128, 128)})
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out, report = tmp_path / "out.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", src, out, "--type", "f32", "--report", report)
    dropped = [t["name"] for t in json.loads(report.read_text())["tensors"] if t["target"] == "dropped"]
    assert sorted(dropped) == sorted(n for n in tensors if n.startswith("model.mtp_"))
    assert _same_tensors(out, ours_f32("ernie4_5_moe")) == {"F32"}


def test_llama4_multimodal_class_is_written_as_its_text_model(tmp_path):
    """Llama4ForConditionalGeneration: config.json's text_config is the text model's, its tensors are under
    language_model., and llama.cpp's converter writes them as llama4 without the vision tower and projector
    (those go only into its --mmproj file): so does qconvert, each tower tensor dropped with a note."""
    kind = "llama4_vl"
    ours, report = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", model_dir(kind), ours, "--type", "f32", "--report", report)
    theirs = reference_f32(kind)
    assert _same_tensors(ours, theirs) == {"F32"}
    assert _model_keys(ours) == _model_keys(theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == "llama4"
    planned = json.loads(report.read_text())["tensors"]
    dropped = {t["name"] for t in planned if t["target"] == "dropped"}
    towers = {t["name"] for t in planned if t["name"].startswith(("vision_model.", "multi_modal_projector."))}
    assert dropped and dropped == towers and "multi_modal_projector.linear_1.weight" in towers
    assert {t["out_name"] for t in planned if t["target"] != "dropped"} == set(gguf_tensors(ours))

    from transformers import Llama4ForConditionalGeneration

    model = Llama4ForConditionalGeneration.from_pretrained(str(model_dir(kind)), dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():  # its text model, as the GGUF holds it
        want = model.language_model(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())  # measured 2.5e-6
    assert want.std(axis=-1).min() > 0.3
    # back: the text model's own class, with its logits
    out = tmp_path / "hf"
    run_cli("gguf->hf", ours, out, "--type", "f32")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    assert np.array_equal(fixtures_archs.transformers_logits(out, PROMPT), want)


def test_mtp_layers_the_config_does_not_declare_are_refused(tmp_path):
    """A GLM-4.5 checkpoint holding an MTP layer its config does not count (num_nextn_predict_layers 0): block_count
    could not cover it (llama.cpp's converter cannot map it either), so it is one line naming config.json, exit 2,
    nothing written."""
    src = tmp_path / "src"
    shutil.copytree(model_dir("glm4_moe"), src)
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32", check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "declares 0 multi-token-prediction block(s) but the checkpoint holds 1" in lines[0]
    assert "config.json" in lines[0] and "Traceback" not in proc.stderr and not out.exists()
