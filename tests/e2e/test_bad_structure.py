"""Structurally bad checkpoints (found by fuzzing real gptqmodel files): config values of the wrong type or
range, tensors of the wrong dtype or shape, required tensors missing. Each is a real fixture copied and
mutated, refused with one line naming the file and the tensor or key, exit 2, nothing at OUT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fixtures_qqq
from helpers import edit_safetensors, expect_user_error, run_cli
from hqq_env import hqqfx  # noqa: F401  (the hqq fixtures: qwen2 base, HQQ safetensors)
from qconvert.converters.errors import BadInput
from qconvert.converters.run import check_required_tensors
from qconvert.formats.gptq.reader import GptqSource
from qconvert.formats.hf.reader import HfSource
from qconvert.formats.qqq.reader import QqqSource

LAYER1 = "model.layers.1"


@pytest.fixture(scope="module")
def qfx():
    return fixtures_qqq.ensure_qqq_fixtures()


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def ckpt(fx, tmp_path):
    return _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path)


def _edit_tensors(folder, fn):
    edit_safetensors(folder / "model.safetensors", fn)


def _relabel(path, name, dtype):
    """Change one tensor's dtype in the safetensors header, bytes untouched (the same size: F16 -> I16/U16,
    F32 -> I32), as a corrupted or hand-edited header would."""
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[name]["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _edit_qc(folder, fn):
    """Edit the quantization config in config.json and quantize_config.json alike."""
    _edit_json(folder / "config.json", lambda cfg: fn(cfg["quantization_config"]))
    if (folder / "quantize_config.json").exists():
        _edit_json(folder / "quantize_config.json", fn)


def _gguf_error(folder, tmp_path, *needles, pair="gptq->gguf"):
    return expect_user_error(pair, folder, tmp_path, *needles, out_name="out.gguf")


# -- GPTQ config values -------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, needle", [
    ("bits", "four", "quantization_config.bits is 'four'"),
    ("bits", [4], "quantization_config.bits is [4]"),
    ("group_size", "32", "quantization_config.group_size is '32'"),
    ("group_size", 0, "quantization_config.group_size is 0"),
    ("sym", "true", "quantization_config.sym is 'true'"),
    ("desc_act", 0, "quantization_config.desc_act is 0"),
    ("checkpoint_format", ["gptq"], "quantization_config.checkpoint_format is ['gptq']"),
    ("dynamic", ["+:.*"], "quantization_config.dynamic is ['+:.*']"),
])
def test_quantization_config_value_of_the_wrong_type(ckpt, tmp_path, key, value, needle):
    _edit_qc(ckpt, lambda qc: qc.update({key: value}))
    _gguf_error(ckpt, tmp_path, "config.json", needle)


def test_bits_as_gptqmodel_reads_them(ckpt, tmp_path):
    """gptqmodel's config reader takes "4" and 4.0 for 4 bits (_normalize_quant_bits): so does qconvert."""
    outs = []
    for i, bits in enumerate((4, "4", 4.0)):
        _edit_qc(ckpt, lambda qc: qc.update(bits=bits))
        outs.append(tmp_path / f"o{i}.gguf")
        run_cli("gptq->gguf", ckpt, outs[-1], "--quiet")
    assert outs[0].read_bytes() == outs[1].read_bytes() == outs[2].read_bytes()


@pytest.mark.parametrize("dynamic, needle", [
    ({"+:model.layers.(": {"bits": 8}}, "'+:model.layers.(' is not a valid regular expression"),
    ({"+:.*q_proj": {"bits": "eight"}}, "quantization_config.dynamic.+:.*q_proj.bits is 'eight'"),
    ({".*up_proj": {"group_size": [32]}}, "quantization_config.dynamic..*up_proj.group_size is [32]"),
    ({"+:.*o_proj": {"desc_act": None, "group_size": 0}}, "quantization_config.dynamic.+:.*o_proj.group_size is 0"),
    ({"+:.*": 8}, "quantization_config.dynamic.+:.* is a number: expected a JSON object"),
    ({"-:.*lm_head": None}, "quantization_config.dynamic.-:.*lm_head is null: expected a JSON object"),
    # a rule that matches no module is checked all the same
    ({"+:^nothing$": {"bits": {"x": 1}}}, "quantization_config.dynamic.+:^nothing$.bits is {'x': 1}"),
])
def test_dynamic_that_is_not_gptqmodels_syntax(ckpt, tmp_path, dynamic, needle):
    _edit_qc(ckpt, lambda qc: qc.update(dynamic=dynamic))
    _gguf_error(ckpt, tmp_path, "config.json", needle)


def test_dynamic_exclusions_come_first_as_in_gptqmodel(ckpt, tmp_path):
    """gptqmodel moves every `-:` key before the others: a down_proj matched by a `+:` key written first
    and by a `-:` key after it is excluded, and so cannot carry a qweight."""
    _edit_qc(ckpt, lambda qc: qc.update(dynamic={"+:.*down_proj": {"bits": 4}, "-:.*down_proj": {}}))
    _gguf_error(ckpt, tmp_path, "model.safetensors", "model.layers.0.mlp.down_proj.qweight", "'-:' rule")


def test_dynamic_overrides_are_read_per_module(fx, tmp_path):
    """An override is what the data is read with: an 8-bit config whose `dynamic` says the (4-bit) layer
    linears are 4-bit converts exactly; without that override the same file is refused."""
    ckpt = _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path)
    _edit_qc(ckpt, lambda qc: qc.update(bits=8, dynamic={r"+:^model\.layers\.\d+\.": {"bits": 4}}))
    out = tmp_path / "ok.gguf"
    run_cli("gptq->gguf", ckpt, out, "--quiet")
    assert out.stat().st_size > 0
    _edit_qc(ckpt, lambda qc: qc.update(dynamic={r"+:^model\.layers\.1\.": {"bits": 4}}))
    _gguf_error(ckpt, tmp_path, "model.layers.0.", "qweight")


def test_module_schemes_match_gptqmodels_own_resolution(fx):
    """gptqmodel's QuantizeConfig (its ordering of the keys) and dynamic_get decide bits, group size and
    exclusion per module; qconvert's reading of the same dynamic agrees on every module of the fixture."""
    from gptqmodel.quantization.config import QuantizeConfig, dynamic_get

    from qconvert.formats.gptq.reader import _dynamic_rules, _module_scheme, _scheme_fields
    from qconvert.converters.validate import ConfigView

    dynamic = {r"+:.*\.mlp\.": {"bits": 8, "group_size": 128}, r".*q_proj": {"group_size": 64},
               r"-:.*layers\.1\.self_attn\.k_proj": {}, r"+:.*layers\.1\..*": {"bits": 2}}
    qc = {"bits": 4, "group_size": 32, "sym": True, "desc_act": False, "dynamic": dynamic}
    theirs = QuantizeConfig(bits=4, group_size=32, dynamic=json.loads(json.dumps(dynamic)), offload_to_disk=False)
    base = _scheme_fields(ConfigView(qc, "config.json"), None)
    rules = _dynamic_rules(qc, "config.json", "", base)
    modules = sorted(GptqSource(fx["variants"]["v1_b4_g32_sym"]["ckpt"]).modules)
    assert len(modules) == 14
    for module in modules:
        ours = _module_scheme(base, rules, module)
        if dynamic_get(theirs.dynamic, module) is False:
            assert ours is None, module
            continue
        assert ours is not None, module
        assert ours.bits == dynamic_get(theirs.dynamic, module, "bits", theirs.bits), module
        assert ours.group_size == dynamic_get(theirs.dynamic, module, "group_size", theirs.group_size), module


# -- model config values ------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("num_hidden_layers", None), ("num_hidden_layers", 2**31), ("hidden_size", "128"), ("intermediate_size", -256),
    ("vocab_size", [512]), ("num_attention_heads", 0), ("tie_word_embeddings", "false"),
])
def test_model_config_value_of_the_wrong_type_or_range(ckpt, tmp_path, key, value):
    _edit_json(ckpt / "config.json", lambda cfg: cfg.update({key: value}))
    _gguf_error(ckpt, tmp_path, "config.json", f"{key} is {value!r}"[:40])


@pytest.mark.parametrize("literal, needle", [
    ("1e99999", "architectures is inf: expected a list"),  # the fuzzer's case: json reads the literal as inf
    ('"LlamaForCausalLM"', "architectures is 'LlamaForCausalLM': expected a list"),  # `in` would match substrings
    ("[3]", "architectures is [3]: expected a list of strings"),
])
def test_architectures_that_are_not_class_names(ckpt, tmp_path, literal, needle):
    """config.json's `architectures` is read by every writer before any tensor (the hf writer's renames, the
    class check): anything but a list of class names is refused naming the key (the fuzzer found a float
    raising a TypeError in model_shapes.canonical_name)."""
    _edit_json(ckpt / "config.json", lambda cfg: cfg.update({"architectures": "@ARCHITECTURES@"}))
    path = ckpt / "config.json"
    path.write_text(path.read_text().replace('"@ARCHITECTURES@"', literal))
    expect_user_error("gptq->hf", ckpt, tmp_path, "config.json", needle, out_name="out")


@pytest.mark.parametrize("where", ["config.json", "quantize_config.json"])
@pytest.mark.parametrize("poison", ["deep", "long number"])
def test_json_bombs_reach_the_user_as_one_line(ckpt, tmp_path, where, poison):
    """validate.read_json bounds depth and number length; read through the GPTQ reader it is one line naming
    the file. quantize_config.json is read when config.json has no quantization_config (AutoGPTQ's layout)."""
    if where == "quantize_config.json":
        _edit_json(ckpt / "config.json", lambda cfg: cfg.pop("quantization_config"))
    path = ckpt / where
    text = path.read_text().rstrip()
    assert text.endswith("}")
    bomb = "[" * 200_000 + "]" * 200_000 if poison == "deep" else "1" * 5000
    path.write_text(text[:-1] + f', "fuzz": {bomb}}}')
    needle = "nested deeper" if poison == "deep" else "a number of 5000 characters"
    _gguf_error(ckpt, tmp_path, where, "not valid JSON", needle)


# -- GPTQ dtypes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("part, dtype, found", [
    ("qzeros", torch.float32, "F32"), ("qweight", torch.float32, "F32"), ("scales", torch.int16, "I16"),
    ("g_idx", torch.float32, "F32"),
])
def test_gptq_part_of_the_wrong_dtype(ckpt, tmp_path, part, dtype, found):
    """The bytes relabelled in the header (a reinterpreting view: same size, same offsets). A qzeros read
    as F32 used to convert with 'exact' verdicts that verify then found 0.074 off."""
    name = f"model.layers.0.self_attn.v_proj.{part}"
    _edit_tensors(ckpt, lambda t: t.update({name: t[name].view(dtype)}))
    _gguf_error(ckpt, tmp_path, "model.safetensors", name, f"{part} dtype {found}")


# -- GPTQ shapes --------------------------------------------------------------------------------------

def _cut_outputs(t, prefix, keep):
    """Keep the first `keep` output channels of a 4-bit module, consistently in every part."""
    t[f"{prefix}.qweight"] = t[f"{prefix}.qweight"][:, :keep].contiguous()
    t[f"{prefix}.qzeros"] = t[f"{prefix}.qzeros"][:, : keep // 8].contiguous()
    t[f"{prefix}.scales"] = t[f"{prefix}.scales"][:, :keep].contiguous()


def _cut_inputs(t, prefix, keep, group=32):
    """Keep the first `keep` input channels of a 4-bit g32 module, consistently in every part."""
    t[f"{prefix}.qweight"] = t[f"{prefix}.qweight"][: keep // 8].contiguous()
    t[f"{prefix}.qzeros"] = t[f"{prefix}.qzeros"][: keep // group].contiguous()
    t[f"{prefix}.scales"] = t[f"{prefix}.scales"][: keep // group].contiguous()
    t[f"{prefix}.g_idx"] = t[f"{prefix}.g_idx"][:keep].contiguous()


def test_gptq_outputs_that_do_not_match_the_config(ckpt, tmp_path):
    """k_proj cut to half its outputs in every part: self-consistent, but not the num_key_value_heads *
    head_dim = 64 the config gives."""
    prefix = f"{LAYER1}.self_attn.k_proj"
    _edit_tensors(ckpt, lambda t: _cut_outputs(t, prefix, 32))
    _gguf_error(ckpt, tmp_path, "model.safetensors", f"{prefix}.qweight", "out_features 32",
                "config.json says 64 (num_key_value_heads * head_dim)")


def test_gptq_inputs_that_do_not_match_the_config(ckpt, tmp_path):
    prefix = f"{LAYER1}.self_attn.o_proj"
    _edit_tensors(ckpt, lambda t: _cut_inputs(t, prefix, 64))
    _gguf_error(ckpt, tmp_path, "model.safetensors", f"{prefix}.qweight", "in_features 64",
                "config.json says 128 (num_attention_heads * head_dim)")


@pytest.mark.parametrize("name, cut, needle", [
    (f"{LAYER1}.mlp.up_proj.scales", lambda x: x[:-1], "scales shape (3, 256) does not match qweight (16, 256)"),
    (f"{LAYER1}.mlp.up_proj.scales", lambda x: x.reshape(-1), "scales shape (1024,) is not 2-D"),
    (f"{LAYER1}.self_attn.q_proj.qzeros", lambda x: x[:, :-1], "qzeros shape (4, 15) does not match"),
    (f"{LAYER1}.mlp.up_proj.g_idx", lambda x: x[:-32], "g_idx shape (96,) does not match"),
])
def test_gptq_partners_that_disagree_with_qweight(ckpt, tmp_path, name, cut, needle):
    _edit_tensors(ckpt, lambda t: t.update({name: cut(t[name]).contiguous()}))
    _gguf_error(ckpt, tmp_path, "model.safetensors", name, needle)


def test_three_bit_qweight_rows_that_are_not_whole_runs(fx, tmp_path):
    """3-bit codes come in runs of 32 codes in 3 words: 11 rows cannot be unpacked."""
    ckpt = _copy(fx["variants"]["v1_b3_g32_sym"]["ckpt"], tmp_path)
    name = "model.layers.0.mlp.gate_proj.qweight"
    _edit_tensors(ckpt, lambda t: t.update({name: t[name][:-1].contiguous()}))
    _gguf_error(ckpt, tmp_path, "model.safetensors", name, "rows 11 do not hold whole 3-bit codes")


@pytest.mark.parametrize("name, cut, needle", [
    ("model.embed_tokens.weight", lambda x: x[:-1], "shape (511, 128) does not match config.json: expected "
                                                    "(512, 128) from vocab_size, hidden_size"),
    ("lm_head.weight", lambda x: x[:, :64], "expected (512, 128)"),
    ("model.norm.weight", lambda x: x[:64], "shape (64,) does not match config.json: expected (128,) from hidden_size"),
    (f"{LAYER1}.post_attention_layernorm.weight", lambda x: x[None], "shape (1, 128)"),
])
def test_gptq_dense_tensor_that_does_not_match_the_config(ckpt, tmp_path, name, cut, needle):
    _edit_tensors(ckpt, lambda t: t.update({name: cut(t[name]).contiguous()}))
    _gguf_error(ckpt, tmp_path, "model.safetensors", name, needle)


def test_gptq_stray_qweight_and_orphan_partners(fx, ckpt, tmp_path):
    prefix = f"{LAYER1}.mlp.gate_proj"
    _edit_tensors(ckpt, lambda t: [t.pop(f"{prefix}.{p}") for p in ("qzeros", "scales", "g_idx")])
    _gguf_error(ckpt, tmp_path, "model.safetensors", f"{prefix}.qzeros", "qweight without qzeros")
    other = _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path, "other")
    prefix = f"{LAYER1}.mlp.up_proj"
    _edit_tensors(other, lambda t: t.pop(f"{prefix}.qweight"))
    _gguf_error(other, tmp_path, "other/model.safetensors", f"tensor {prefix}", "g_idx, qzeros, scales without qweight")


# -- required tensors ---------------------------------------------------------------------------------

def test_untied_model_without_its_head(ckpt, tmp_path):
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is False
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    _gguf_error(ckpt, tmp_path, "ckpt", "tensor lm_head.weight", "tie_word_embeddings false")


def test_a_layer_missing_in_the_middle(ckpt, tmp_path):
    """Three layers in config.json, the file has layers 0 and 2: layer 1 is absent."""
    _edit_json(ckpt / "config.json", lambda cfg: cfg.update(num_hidden_layers=3))

    def move(t):
        for name in [n for n in t if n.startswith(f"{LAYER1}.")]:
            t["model.layers.2." + name[len(LAYER1) + 1:]] = t.pop(name)
    _edit_tensors(ckpt, move)
    _gguf_error(ckpt, tmp_path, "tensor model.layers.1", "num_hidden_layers 3", "no tensor of layer 1")


def test_a_last_layer_missing_in_a_dense_model(fx, tmp_path):
    hf = _copy(fx["bases"]["base"], tmp_path, "hf")
    _edit_tensors(hf, lambda t: [t.pop(n) for n in [n for n in t if n.startswith(f"{LAYER1}.")]])
    _gguf_error(hf, tmp_path, "tensor model.layers.1", "no tensor of layer 1", pair="hf->gguf")


def test_qqq_folder_whose_safetensors_holds_no_tensors(qfx, tmp_path):
    """It used to convert with exit 0 into an empty output."""
    from safetensors.torch import save_file

    q = _copy(qfx["variants"]["qqq_g128"]["ckpt"], tmp_path, "q")
    save_file({}, str(q / "model.safetensors"))
    _gguf_error(q, tmp_path, "model.safetensors", "holds no tensors", pair="qqq->gguf")


# -- QQQ and hf shapes and config values --------------------------------------------------------------

def test_qqq_o_proj_cut_to_half_its_rows(qfx, tmp_path):
    """B [in/16, out*2]: half the rows is a 64-input o_proj, which the kernel tiles allow and the config
    (4 heads of 32) does not. Read unchecked it converted into a silently wrong model."""
    q = _copy(qfx["variants"]["qqq_g128"]["ckpt"], tmp_path, "q")
    name = f"{LAYER1}.self_attn.o_proj.B"
    _edit_tensors(q, lambda t: t.update({name: t[name][: t[name].shape[0] // 2].contiguous()}))
    _gguf_error(q, tmp_path, "model.safetensors", name, "in_features 64", "config.json says 128", pair="qqq->gguf")


@pytest.mark.parametrize("key, value, needle", [
    ("bits", [4], "quantization_config.bits is [4]"), ("bits", "4bit", "quantization_config.bits is '4bit'"),
    ("group_size", "128", "quantization_config.group_size is '128'"),
    ("sym", "true", "quantization_config.sym is 'true'"),
])
def test_qqq_config_value_of_the_wrong_type(qfx, tmp_path, key, value, needle):
    q = _copy(qfx["variants"]["qqq_g128"]["ckpt"], tmp_path, "q")
    _edit_qc(q, lambda qc: qc.update({key: value}))
    _gguf_error(q, tmp_path, "config.json", needle, pair="qqq->gguf")


def test_qqq_dense_tensor_that_does_not_match_the_config(qfx, tmp_path):
    q = _copy(qfx["variants"]["qqq_gm1"]["ckpt"], tmp_path, "q")
    name = "model.embed_tokens.weight"
    _edit_tensors(q, lambda t: t.update({name: t[name][:500].contiguous()}))
    _gguf_error(q, tmp_path, "model.safetensors", name, "(500, 128)", "vocab_size", pair="qqq->gguf")


@pytest.mark.parametrize("name, cut, needle", [
    ("model.embed_tokens.weight", lambda x: x[:256], "shape (256, 128)"),
    (f"{LAYER1}.mlp.down_proj.weight", lambda x: x[:, :128], "expected (128, 256) from hidden_size, intermediate_size"),
    (f"{LAYER1}.self_attn.k_proj.weight", lambda x: x[:32], "num_key_value_heads * head_dim"),
])
def test_hf_tensor_that_does_not_match_the_config(fx, tmp_path, name, cut, needle):
    hf = _copy(fx["bases"]["base"], tmp_path, "hf")
    _edit_tensors(hf, lambda t: t.update({name: cut(t[name]).contiguous()}))
    _gguf_error(hf, tmp_path, "model.safetensors", name, needle, pair="hf->gguf")


def test_hf_untied_model_without_its_head(fx, tmp_path):
    hf = _copy(fx["bases"]["base"], tmp_path, "hf")
    _edit_tensors(hf, lambda t: t.pop("lm_head.weight"))
    _gguf_error(hf, tmp_path, "tensor lm_head.weight", pair="hf->gguf")


# -- every real checkpoint passes -----------------------------------------------------------------------

def test_every_fixture_variant_passes_the_structure_checks(fx, qfx):
    """The rules hold for every checkpoint gptqmodel made here (all bit widths, groups, act-order, v1/v2,
    asym, rotation, QQQ both modes) and for the dense base: each record is checked, nothing refused."""
    sources = [GptqSource(v["ckpt"]) for v in fx["variants"].values()]
    sources.append(GptqSource(qfx["variants"]["rot_b4_g128"]["ckpt"]))
    sources += [QqqSource(qfx["variants"][n]["ckpt"]) for n in ("qqq_g128", "qqq_gm1")]
    sources.append(HfSource(fx["bases"]["base"]))
    for source in sources:
        names = [rec.name for rec in source.records()]
        assert len(names) == 3 + 2 * 9, (source.path, len(names))  # embed, norm, head; 7 linears + 2 norms a layer
        check_required_tensors(source, names)


def test_required_tensor_checks_cover_every_source_format(fx, tmp_path):
    """The model-level checks run on records, so a source of any format gets them (here a GGUF made from
    the fixture, whose config says untied, read back without its output tensor)."""
    gguf_path = tmp_path / "m.gguf"
    run_cli("gptq->gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], gguf_path, "--quiet")
    from qconvert.converters.run import open_source

    source = open_source("gguf", gguf_path)
    names = [rec.name for rec in source.records()]
    check_required_tensors(source, names)
    with pytest.raises(BadInput, match="lm_head.weight"):
        check_required_tensors(source, [n for n in names if n != "lm_head.weight"])
    with pytest.raises(BadInput, match="layer 1"):
        check_required_tensors(source, [n for n in names if not n.startswith(f"{LAYER1}.")])
    with pytest.raises(BadInput, match="holds no tensors"):
        check_required_tensors(source, [])
    # the per-tensor rules of a known architecture, on the GGUF reader's names, naming the GGUF file
    recs = list(source.records())
    files = {r.name: r.source_file for r in recs}
    k_proj = f"{LAYER1}.self_attn.k_proj.weight"
    with pytest.raises(BadInput, match="LlamaForCausalLM has it in every layer") as e:
        check_required_tensors(source, [n for n in names if n != k_proj], files)
    assert e.value.path == str(gguf_path) and e.value.tensor == k_proj
    with pytest.raises(BadInput, match="layer 5 is beyond config.json's num_hidden_layers 2") as e:
        check_required_tensors(source, names + ["model.layers.5.input_layernorm.weight"], files)
    with pytest.raises(BadInput, match="not a tensor of LlamaForCausalLM"):
        check_required_tensors(source, names + ["model.layers.0.mlp.experts.0.up_proj.weight"], files)


def _wide_llama():
    """tests/support/fixtures_uqff.py's F32 llama (the uqff fixtures' base), built once."""
    import fixtures_uqff

    root = fixtures_uqff.DEFAULT_ROOT
    if not (root / "wide" / ".done").exists():
        fixtures_uqff.ensure_uqff_fixtures()
    return root / "wide"


# -- float parameters stored as integers (fuzz findings F4, F8) ----------------------------------------

@pytest.mark.parametrize("seed, pair, name, dtype, role", [
    ("hf", "hf->hf", "model.layers.0.input_layernorm.weight", "U16", "a norm weight"),
    ("hf", "hf->hf", "lm_head.weight", "I16", "the output head"),
    ("hf", "hf->gguf", f"{LAYER1}.mlp.down_proj.weight", "I16", "a linear layer's weight"),
    ("wide", "hf->hf", "model.layers.0.input_layernorm.weight", "I32", "a norm weight"),  # F32 -> I32: was copied
    ("qqq", "qqq->hf", "model.norm.weight", "I16", "a norm weight"),
    ("gptq", "gptq->hf", "model.embed_tokens.weight", "I16", "an embedding"),
])
def test_float_parameter_stored_as_an_integer(fx, qfx, tmp_path, seed, pair, name, dtype, role):
    """A header that relabels a float parameter as an integer: refused naming file, tensor and dtype (it used
    to be a plan refusal naming no file, or an I32 norm copied into the output as int32)."""
    src = {"hf": lambda: fx["bases"]["base"], "wide": _wide_llama,
           "qqq": lambda: qfx["variants"]["qqq_g128"]["ckpt"],
           "gptq": lambda: fx["variants"]["v1_b4_g32_sym"]["ckpt"]}[seed]()
    folder = _copy(src, tmp_path, "in")
    _relabel(folder / "model.safetensors", name, dtype)
    expect_user_error(pair, folder, tmp_path, "in/model.safetensors", f"tensor {name}", f"dtype {dtype}", role,
                      out_name="out.gguf" if pair.endswith("gguf") else "out")


def test_integer_buffers_of_other_architectures_pass_and_odd_widths_do_not(fx, tmp_path):
    """Outside the known layouts an unknown tensor passes through as it is when it is a float or an integer
    buffer real checkpoints carry (position_ids int64, a bool mask); an I16 tensor of no known role is no
    buffer's dtype, and no writer stores it: refused naming file, tensor and dtype."""
    hf = _copy(fx["bases"]["base"], tmp_path, "in")
    _edit_json(hf / "config.json", lambda cfg: cfg.update(model_type="olmo"))  # not a known layout
    extra = {"model.vision.position_ids": torch.arange(8, dtype=torch.int64)[None],
             "model.vision.mask": torch.ones(4, 4, dtype=torch.bool), "model.vision.scale": torch.ones(3)}
    _edit_tensors(hf, lambda t: t.update(extra))
    out = tmp_path / "ok"
    run_cli("hf->hf", hf, out, "--quiet")
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got["model.vision.position_ids"], extra["model.vision.position_ids"])
    assert got["model.vision.mask"].dtype == torch.bool
    _edit_tensors(hf, lambda t: t.update({"model.vision.counts": torch.zeros(4, dtype=torch.int16)}))
    expect_user_error("hf->hf", hf, tmp_path, "in/model.safetensors", "tensor model.vision.counts", "dtype I16")


# -- every tensor of a known architecture (F5) ----------------------------------------------------------

def _q(prefix, parts=("qweight", "qzeros", "scales", "g_idx")):
    return [f"{prefix}.{p}" for p in parts]


@pytest.mark.parametrize("seed, pair, removed, missing, needle", [
    ("hf", "hf->hf", [f"{LAYER1}.self_attn.k_proj.weight"], f"{LAYER1}.self_attn.k_proj.weight",
     "LlamaForCausalLM has it in every layer"),
    ("hf", "hf->hf", ["model.norm.weight"], "model.norm.weight", "LlamaForCausalLM needs it"),
    ("hf", "hf->gguf", ["model.embed_tokens.weight"], "model.embed_tokens.weight", "LlamaForCausalLM needs it"),
    ("gptq", "gptq->hf", ["model.layers.0.input_layernorm.weight"], "model.layers.0.input_layernorm.weight",
     "in every layer"),
    ("gptq", "gptq->hf", _q(f"{LAYER1}.self_attn.q_proj"), f"{LAYER1}.self_attn.q_proj.weight", "in every layer"),
    ("qqq", "qqq->hf", _q(f"{LAYER1}.mlp.down_proj", ("B", "s_channel", "s_group")), f"{LAYER1}.mlp.down_proj.weight",
     "in every layer"),
    ("qqq", "qqq->hf", [f"{LAYER1}.input_layernorm.weight"], f"{LAYER1}.input_layernorm.weight", "in every layer"),
])
def test_a_tensor_missing_from_a_known_architecture(fx, qfx, tmp_path, seed, pair, removed, missing, needle):
    """One tensor (or a whole quantized linear) removed: `->hf` used to exit 0 with a model transformers
    would complete with random weights."""
    src = {"hf": lambda: fx["bases"]["base"], "qqq": lambda: qfx["variants"]["qqq_g128"]["ckpt"],
           "gptq": lambda: fx["variants"]["v1_b4_g32_sym"]["ckpt"]}[seed]()
    folder = _copy(src, tmp_path, "in")
    _edit_tensors(folder, lambda t: [t.pop(n) for n in removed])
    expect_user_error(pair, folder, tmp_path, "in/model.safetensors", f"tensor {missing}", "missing", needle,
                      "random values", out_name="out.gguf" if pair.endswith("gguf") else "out")


def test_qwen2_biases_are_required(hqqfx, tmp_path):
    """Qwen2's q/k/v projections always have a bias (nn.Linear(..., bias=True) in Qwen2Attention)."""
    q = _copy(hqqfx["root"] / "base_qwen2", tmp_path, "in")
    name = f"{LAYER1}.self_attn.v_proj.bias"
    _edit_tensors(q, lambda t: t.pop(name))
    expect_user_error("hf->hf", q, tmp_path, "in/model.safetensors", f"tensor {name}", "qwen2")


@pytest.mark.parametrize("key, missing", [("attention_bias", "model.layers.0.self_attn.q_proj.bias"),
                                          ("mlp_bias", "model.layers.0.mlp.gate_proj.bias")])
def test_biases_the_config_promises(fx, tmp_path, key, missing):
    """A llama config with attention_bias / mlp_bias true builds biased linears: a checkpoint without the
    biases is not that model. Without the key (false) the biases are optional: GPTQ-for-LLaMa saved a zero
    bias for every linear, and such a checkpoint converts."""
    ckpt = _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path, "in")
    _edit_json(ckpt / "config.json", lambda cfg: cfg.update({key: True}))
    expect_user_error("gptq->hf", ckpt, tmp_path, "in/model.safetensors", f"tensor {missing}", f"{key} true")
    _edit_json(ckpt / "config.json", lambda cfg: cfg.update({key: "yes"}))
    expect_user_error("gptq->hf", ckpt, tmp_path, "config.json", f"{key} is 'yes'")


def test_optional_names_real_checkpoints_carry(fx, tmp_path):
    """A zero bias on a quantized linear (GPTQ-for-LLaMa's QuantLinear saved one for every layer) and the
    per-layer rotary inv_freq buffer older transformers saved: both convert, the bias kept."""
    ckpt = _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path, "in")
    bias = f"{LAYER1}.mlp.up_proj.bias"
    _edit_tensors(ckpt, lambda t: t.update({bias: torch.zeros(256, dtype=torch.float16),
                                            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.rand(16)}))
    out = tmp_path / "ok"
    run_cli("gptq->hf", ckpt, out, "--quiet")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "model.safetensors"))[bias].float(), torch.zeros(256))


# -- names a known architecture does not have (F6) ------------------------------------------------------

def _rename(old, new):
    return lambda t: t.update({new: t.pop(old)})


@pytest.mark.parametrize("seed, pair, edit, named, needle", [
    ("hf", "hf->hf", _rename("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weightx"),
     "model.layers.0.self_attn.o_proj.weightx", "not a tensor of LlamaForCausalLM"),
    ("hf", "hf->hf", _rename("model.layers.0.mlp.up_proj.weight", "model.fuzzed_layers.0.mlp.up_proj.weight"),
     "model.fuzzed_layers.0.mlp.up_proj.weight", "not a tensor of LlamaForCausalLM"),
    ("hf", "hf->gguf", _rename("model.norm.weight", "model.layers.99.model.norm.weight"),
     "model.layers.99.model.norm.weight", "layer 99 is beyond config.json's num_hidden_layers 2"),
    ("gptq", "gptq->hf", lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(128).half()}),
     "model.layers.2.input_layernorm.weight", "layer 2 is beyond"),
    # Qwen3's per-head norms are not llama's
    ("gptq", "gptq->hf", lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(32).half()}),
     "model.layers.0.self_attn.q_norm.weight", "not a tensor of LlamaForCausalLM"),
    # a quantized part renamed is left over as a dense tensor of no known name
    ("qqq", "qqq->hf", _rename(f"{LAYER1}.mlp.down_proj.s_channel", f"{LAYER1}.mlp.down_proj.s_chan"),
     f"{LAYER1}.mlp.down_proj", "s_channel"),
])
def test_a_name_a_known_architecture_does_not_have(fx, qfx, tmp_path, seed, pair, edit, named, needle):
    src = {"hf": lambda: fx["bases"]["base"], "qqq": lambda: qfx["variants"]["qqq_gm1"]["ckpt"],
           "gptq": lambda: fx["variants"]["v1_b4_g32_sym"]["ckpt"]}[seed]()
    folder = _copy(src, tmp_path, "in")
    _edit_tensors(folder, edit)
    expect_user_error(pair, folder, tmp_path, "in/model.safetensors", f"tensor {named}", needle,
                      out_name="out.gguf" if pair.endswith("gguf") else "out")


def test_hqq_source_gets_the_same_checks(hqqfx, tmp_path):
    """The checks run on the records' names, which the HQQ reader yields as every reader does (one
    `<module>.weight` per quantized linear): a layer beyond num_hidden_layers in an HQQ
    safetensors checkpoint (written by hqq through transformers) and a name llama does not have (Qwen3's k_norm)
    are refused the same way. (A missing tensor the HQQ reader refuses itself, before this check.)"""
    h = _copy(hqqfx["root"] / "b4_g64_ax1" / "tf", tmp_path, "in")
    _edit_tensors(h, lambda t: t.update({"model.layers.7.input_layernorm.weight": t["model.norm.weight"].clone()}))
    expect_user_error("hqq->hf", h, tmp_path, "in/model.safetensors", "tensor model.layers.7.input_layernorm.weight",
                      "layer 7 is beyond")
    _edit_tensors(h, lambda t: [t.pop("model.layers.7.input_layernorm.weight"),
                                t.update({"model.layers.0.self_attn.k_norm.weight": t["model.norm.weight"][:32].clone()})])
    expect_user_error("hqq->hf", h, tmp_path, "in/model.safetensors", "tensor model.layers.0.self_attn.k_norm.weight",
                      "not a tensor of LlamaForCausalLM")


# -- act-order without g_idx (F7) ------------------------------------------------------------------------

def test_act_order_module_without_g_idx(fx, tmp_path):
    """desc_act true: the group of input k is g_idx[k]. Without g_idx gptqmodel loads the identity order its
    QuantLinear starts with (its loader checks only the qweights), a different model: refused. Without
    act-order the natural order is g_idx, and a file without it converts."""
    ckpt = _copy(fx["variants"]["v1_b4_g32_sym_act"]["ckpt"], tmp_path, "in")
    name = f"{LAYER1}.self_attn.v_proj.g_idx"
    _edit_tensors(ckpt, lambda t: t.pop(name))
    expect_user_error("gptq->hf", ckpt, tmp_path, "in/model.safetensors", f"tensor {name}", "desc_act true")
    plain = _copy(fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path, "plain")
    _edit_tensors(plain, lambda t: t.pop(name))
    run_cli("gptq->hf", plain, tmp_path / "ok", "--quiet")


# -- the multi-token-prediction block transformers ignores (class_tensors._compare_mtp_block) -------------------

QWEN35_GPTQ = Path(__file__).parents[1] / "producer_fixtures" / "gptq_qwen35" / "model"  # gptqmodel's, with mtp.*


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop("mtp.layers.0.self_attn.k_norm.weight"),
     ("tensor mtp.layers.0.self_attn.k_norm.weight", "missing: the multi-token-prediction block")),
    (lambda t: t.__setitem__("mtp.fuzzed_fc.weight", t.pop("mtp.fc.weight")),
     ("tensor mtp.fc.weight", "missing: the multi-token-prediction block")),
    (lambda t: t.__setitem__("mtp.layers.1.input_layernorm.weight", t["mtp.layers.0.input_layernorm.weight"].clone()),
     ("tensor mtp.layers.1.input_layernorm.weight", "not a tensor of the multi-token-prediction block")),
    (lambda t: t.__setitem__("mtp.norm.weight", t["mtp.norm.weight"][:64].clone()),
     ("tensor mtp.norm.weight", "shape (64,) is not the (128,)")),
    (lambda t: t.__setitem__("", t.pop("mtp.pre_fc_norm_embedding.weight")),  # refused by the header reader
     ("model.safetensors", "a tensor has an empty name")),
    (lambda t: t.__setitem__("mtp.layers.999999.input_layernorm.weight", t.pop("mtp.layers.0.input_layernorm.weight")),
     ("tensor mtp.layers.0.input_layernorm.weight", "missing: the multi-token-prediction block")),
], ids=["removed", "renamed", "extra-layer", "misshapen", "empty-name", "far-layer"])
def test_qwen_mtp_block_is_checked_like_the_trunk(tmp_path, edit, needles):
    """Qwen3.5's `mtp.*` block, which transformers ignores on load but llama.cpp's converter keeps and vLLM's MTP
    drafter loads, must hold its own modules and one full-attention layer's tensors per declared layer, in their
    shapes: a removed, renamed, extra or misshapen one converted with exit 0 before (scripts/fuzz, seed 2029). The
    unmutated checkpoint converts (tests/formats/gguf/test_gguf_archs_hybrid.py)."""
    folder = tmp_path / "in"
    shutil.copytree(QWEN35_GPTQ, folder)
    edit_safetensors(next(folder.glob("*.safetensors")), edit)
    expect_user_error("gptq->hf", folder, tmp_path, *needles, out_name="out")


@pytest.mark.parametrize("declared", [2, 2 ** 31])
def test_qwen_mtp_layers_declared_beyond_the_tensors(tmp_path, declared):
    """config.json's `mtp_num_hidden_layers` set to 2**31 made the check list 2**31 layers' names and die of a
    MemoryError (scripts/fuzz, seed 2029, gptq case 768 at 1f4511e). Names are now listed one layer past those the
    tensors hold, so any count above them is refused by its first missing layer, in one line that names the key."""
    folder = tmp_path / "in"
    shutil.copytree(QWEN35_GPTQ, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    config["mtp_num_hidden_layers"] = declared
    (folder / "config.json").write_text(json.dumps(config))
    expect_user_error("gptq->hf", folder, tmp_path, "tensor mtp.layers.1.", "config.json's mtp_num_hidden_layers "
                      f"declares {declared} multi-token-prediction layers, the checkpoint holds 1", out_name="out")


def test_a_parameter_no_module_of_the_class_has_is_refused(tmp_path):
    """A tensor under one of the class's modules whose parameter name no module of the class has (a renamed GPTQ
    partner, `g_idx` -> `g_idxx`) was carried into the output as a tensor of its own (scripts/fuzz, seed 2029)."""
    folder = tmp_path / "in"
    shutil.copytree(QWEN35_GPTQ, folder)
    name = "model.layers.0.mlp.gate_proj.g_idx"
    edit_safetensors(next(folder.glob("*.safetensors")), lambda t: t.__setitem__(name + "x", t.pop(name)))
    expect_user_error("gptq->hf", folder, tmp_path, f"tensor {name}x", "not a tensor of Qwen3_5ForCausalLM",
                      "has no 'g_idxx'", out_name="out")


GEMMA4_GPTQ = Path(__file__).parents[1] / "producer_fixtures" / "gptq_gemma4moe" / "model"  # fused float experts


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.pop("model.layers.3.experts.gate_up_proj"),
     ("tensor model.layers.3.experts.gate_up_proj", "missing: Gemma4ForCausalLM has it")),
    (lambda t: t.__setitem__("model.layers.4.experts.down_proj", t["model.layers.4.experts.down_proj"][..., None]),
     ("tensor model.layers.4.experts.down_proj", "shape (4, 128, 64, 1) is not the (4, 128, 64)")),
], ids=["stack-removed", "stack-reshaped"])
def test_fused_expert_stacks_are_checked_like_the_class(tmp_path, edit, needles):
    """gptqmodel leaves Gemma 4's fused experts (`experts.gate_up_proj` [E, 2I, H]) in float, stored as the class
    holds them: one layer's stack removed, or reshaped with a trailing 1, converted with exit 0 (scripts/fuzz, seed
    2029, gptq cases 6674 and 7092). A stack the checkpoint holds under the class's name is now required in every
    layer and compared in shape; per-expert checkpoints and other stored forms (gpt-oss MXFP4) are not asked for
    the class's fused names (class_tensors.compare)."""
    folder = tmp_path / "in"
    shutil.copytree(GEMMA4_GPTQ, folder)
    edit_safetensors(next(folder.glob("*.safetensors")), edit)
    expect_user_error("gptq->hf", folder, tmp_path, *needles, out_name="out")


def test_a_float_parameter_read_as_integers_is_refused(tmp_path):
    """GLM-4.5's router (`mlp.gate.weight`, F32) relabelled I32 in the header was converted as integers near 1e9 with
    exit 0 (scripts/fuzz, seed 2029, gptq case 9961): the role rules name linears and norms, not routers. The class
    check now refuses an integer dtype for any float parameter transformers' class holds."""
    folder = tmp_path / "in"
    shutil.copytree(GEMMA4_GPTQ.parents[1] / "gptq_glm4moe" / "model", folder)
    name = "model.layers.1.mlp.gate.weight"
    edit_safetensors(next(folder.glob("*.safetensors")), lambda t: t.__setitem__(name, t[name].view(torch.int32)))
    expect_user_error("gptq->hf", folder, tmp_path, f"tensor {name}", "dtype int32 is an integer type",
                      "Glm4MoeForCausalLM holds this as a float parameter", out_name="out")
