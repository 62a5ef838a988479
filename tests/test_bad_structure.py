"""Structurally bad checkpoints (found by fuzzing real gptqmodel files): config values of the wrong type or
range, tensors of the wrong dtype or shape, required tensors missing. Each is a real fixture copied and
mutated, refused with one line naming the file and the tensor or key, exit 2, nothing at OUT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import fixtures_qqq
from helpers import edit_safetensors, expect_user_error, run_cli
from qconvert.converters.errors import BadInput
from qconvert.converters.run import check_required_tensors
from qconvert.formats.gptq import GptqSource
from qconvert.formats.hf import HfSource
from qconvert.formats.qqq import QqqSource

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

    from qconvert.formats.gptq import _dynamic_rules, _module_scheme, _scheme_fields
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
    _gguf_error(other, tmp_path, prefix, "g_idx, qzeros, scales without qweight")


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
