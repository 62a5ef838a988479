"""Issue 26 item 2: the quantized forms of the new families keep their codes in GGUF. Each fixture is a real
producer's own 4-bit group-32 symmetric checkpoint of a family's tiny model, made on CPU: gptqmodel's GPTQ
(scripts/producers/gptqmodel_archs.py -> tests/producer_fixtures/gptq_<family>/) or, for a family gptqmodel cannot
quantize, llm-compressor's GPTQ as compressed-tensors (scripts/producers/llmcompressor_archs.py -> ct_<family>/:
ERNIE 4.5-MoE, MiniMax-M2, and Llama 4 in Maverick's layout, dense layers between routed ones, ct_llama4_maverick,
where gptqmodel makes Scout's, every layer routed, gptq_llama4), with the producer's own dequantization of every
quantized module beside it (reference.safetensors) and its runtime's logits (logits.safetensors). For each,
`gptq->gguf` / `ct->gguf` with `--report`:

- every module the producer quantized (every routed and shared expert, every linear-attention projection, the
  attention, the dense MLPs) is in the report with target Q4_0, verdict exact and error 0 (the grid is Q4_0's:
  4 bits, symmetric, 32 wide), and every projection the checkpoint holds outside the MTP block is one of them
  (so the check covers every expert and linear-attention projection, not only those the producer happened to take);
- read back (`gguf->hf --type f32`), every quantized module equals the producer's own dequantization (rounded to
  fp16, as both compute it);
- llama.cpp runs the Q4_0 file within the usual tolerance of the producer's runtime (gptqmodel's own forward on the
  checkpoint in float16 with its torch kernel, DeepSeek-V4's in the bfloat16 gptqmodel quantizes it in
  (scripts/producers/gptqmodel_archs.py DTYPE); transformers 5.17 + compressed-tensors decompressed), stored by the
  producer for the architecture tests' prompt. llama.cpp quantizes the activations to Q8_0 against Q4_0 weights,
  whose noise can flip a top-k routing choice, so it is judged on the mean and on top-1 agreement, as the MoE GPTQ
  test of test_gguf_archs.py does.

DeepSeek-V4 has three: gptqmodel's (in transformers' names) and, made from the float folder in the release's names,
llm-compressor's (ct_deepseek_v4) and auto-round's model-free W4A16 (autoround_deepseek_v4, scripts/producers/
auto_round.py), which keep the release's names; the readers rename them to transformers' (formats/common/
checkpoint.py), checked against gptqmodel's names. auto-round's runtime does not run its checkpoint (it finds none of
the release's names), so llama.cpp on that file is judged against llama.cpp on the float base (FLOAT_BASE_MEAN).

Qwen3.5's out_proj, whose input columns llama.cpp's converter reorders by value head, keeps its codes too: a
value head's columns (head_v_dim 32) are whole groups, so the reorder moves groups with their scales
(GridParams.whole_group_order; test_out_proj_reorder_keeps_groups_only_when_whole for the case where it cannot).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from helpers import llama_logits, run_cli
from qconvert.converters.model_shapes import canonical_name

llama_cpp = pytest.importorskip("llama_cpp")

PRODUCER_FIXTURES = Path(__file__).parents[2] / "producer_fixtures"


def _fixtures() -> dict[str, str]:
    """test id -> fixture folder: every gptqmodel checkpoint (scripts/producers/gptqmodel_archs.py) and, for a family
    gptqmodel cannot quantize, llm-compressor's (scripts/producers/llmcompressor_archs.py), each with its family's name
    (the fixtures_archs kind its versions.json's `base` records); another producer's checkpoint of a family already
    there (DeepSeek-V4 by llm-compressor and by auto-round's model-free mode, both in the release's names) with its
    folder's name."""
    found = {}
    for pattern in ("gptq_*", "ct_*", "autoround_*"):
        for folder in sorted(PRODUCER_FIXTURES.glob(pattern)):
            # "tests/support/fixtures_archs.py KIND (seed 0)"
            kind = json.loads((folder / "versions.json").read_text())["base"].split()[1]
            found[folder.name if kind in found else kind] = folder.name
    return found


FIXTURES = _fixtures()
# test id -> family (the fixtures_archs kind): the id itself but for a second producer's checkpoint of a family
FAMILY = {kind: json.loads((PRODUCER_FIXTURES / folder / "versions.json").read_text())["base"].split()[1]
          for kind, folder in FIXTURES.items()}
# the conversion and the packed-codes suffix of each producer's checkpoint
PAIRS = {"gptq": ("gptq->gguf", ".qweight"), "ct": ("ct->gguf", ".weight_packed"),
         "autoround": ("auto-round->gguf", ".qweight")}
# a checkpoint its producer's runtime does not run (auto-round 0.16's loader finds none of the release's names:
# scripts/producers/auto_round.py): llama.cpp's logits on the Q4_0 file are judged against llama.cpp's on the F32
# conversion of the float base the producer quantized, within the quantization's own error (round to nearest, 4
# bits, groups of 32, on random weights: measured mean 0.18 of a logit range of 7.4, max 1.1, top-1 12 of 16, as
# llm-compressor's GPTQ checkpoint of the same base: 0.20, 1.1, 12 of 16)
FLOAT_BASE_MEAN, FLOAT_BASE_TOP1 = 0.25, 0.625
PROMPT = fixtures_archs.arch_prompt()
# a module whose GGUF form is two tensors (Qwen3-Next's fused linear-attention input, split by llama.cpp's
# converter into attn_qkv and attn_gate; GLM-5's MLA kv_b_proj, split per head into attn_k_b and attn_v_b as
# DeepSeek's): the report names each piece
SPLITS = {"linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
          "self_attn.kv_b_proj": ("self_attn.k_b_proj", "self_attn.v_b_proj")}
# the pieces written as their exact float32 dequantization rather than Q4_0: k_b is kv_b's key rows transposed per
# head, so a Q4_0 block would run across 32 output rows, each with its own GPTQ scale. v_b is kv_b's value rows
# as they are (its groups still run along kv_lora): it keeps its codes (formats/gguf: the DeepSeek kv_b split)
DEQUANTIZED = ("self_attn.k_b_proj",)
# Gemma 4's router (softmax over 4 experts, top 2, per-expert scales) sits near a tie at one position of the prompt
# with these quantized weights: llama.cpp's F32 run of the read-back weights is already 0.017 mean (0.71 max, top-1
# 16 of 16) from transformers' float32 run of the same folder, and the Q4_0 file 0.059 from gptqmodel (top-1 15/16)
MEAN_TOLERANCE = {"gemma4_moe": 0.08}
# the weights a GPTQ producer should quantize: every projection of the decoder layers, per-expert or fused
# (in_proj_a/b/ba, routers, conv kernels, embeddings and the MTP block, which gptqmodel leaves in float16, are not)
PROJECTION = re.compile(r"^model\.layers\.\d+\..*_proj(?:\.weight|\.qweight|\.weight_packed)?$")
NOT_QUANTIZED = re.compile(r"\.in_proj_(?:a|b|ba)\.")
# what the producer itself leaves in float where it should not: gptqmodel 7.6's Gemma 4 module tree has no
# entry for transformers 5.24's fused Gemma4TextExperts, so every routed expert stays float16 (written F16, exact);
# its GLM-5 tree leaves the DSA indexer's per-head weights_proj (a [heads, hidden] scoring weight) in float16; its
# DeepSeek-V4 tree takes q_a / q_b / kv / o_b and the experts: the grouped output projection's o_a_proj (marked not
# to quantize) and the compressor's and indexer's projections (not in the tree) stay bfloat16
LEFT_IN_FLOAT_BY_PRODUCER = {"gemma4_moe": re.compile(r"\.experts\.(?:gate_up_proj|down_proj)$"),
                             "glm_moe_dsa": re.compile(r"\.indexer\.weights_proj\.weight$"),
                             "deepseek_v4": re.compile(r"\.self_attn\.(?:o_a_proj|compressor\..*_proj)\.weight$")}
# the producers that quantize every linear of DeepSeek-V4's layers (llm-compressor: every Linear; auto-round's model-free
# mode: every 2-D weight of the layers but the routers): nothing excused
LEFT_IN_FLOAT_BY_PRODUCER.update({"ct_deepseek_v4": re.compile(r"(?!)"), "autoround_deepseek_v4": re.compile(r"(?!)")})
# families whose transformers class holds its fused experts [E, in, out] (Llama 4) rather than [E, out, in]
TRANSPOSED_EXPERTS = {"llama4", "llama4_text"}


def _pieces(name: str) -> list:
    for fused, parts in SPLITS.items():
        if f".{fused}." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


# one expert's projection of a per-expert checkpoint (gptqmodel's unfused Llama 4 experts, llm-compressor's
# linearized ones)
_PER_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _read_back(back: dict, name: str, transposed: bool) -> torch.Tensor:
    """The read-back weight of a quantized module: its own tensor, or, for an expert of a family whose transformers
    class holds its experts fused (what gguf->hf writes), the expert's [out, in] slice of the fused tensor:
    transposed (Llama 4: gate_up_proj [E, in, 2 * ffn] with the gate columns first, down_proj [E, ffn, hidden]) or
    not (DeepSeek-V4: gate_up_proj [E, 2 * ffn, in] with the gate rows first, down_proj [E, hidden, ffn])."""
    if name in back:
        return back[name]
    m = _PER_EXPERT.match(name)
    if m is None or f"{m['head']}.down_proj" not in back:
        raise KeyError(name)
    e = int(m["index"])
    if m["proj"] == "down_proj":
        down = back[f"{m['head']}.down_proj"][e]
        return down.T if transposed else down
    fused = back[f"{m['head']}.gate_up_proj"][e]
    fused = fused.T if transposed else fused
    ffn = fused.shape[0] // 2
    return fused[:ffn] if m["proj"] == "gate_proj" else fused[ffn:]


@pytest.mark.parametrize("kind", list(FIXTURES))
def test_quantized_checkpoint_keeps_its_codes(kind, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from qconvert.formats.common.release_names import quantized_release_names

    fixture = PRODUCER_FIXTURES / FIXTURES[kind]
    config = json.loads((fixture / "model" / "config.json").read_text())
    with safe_open(str(fixture / "model" / "model.safetensors"), "pt") as f:
        stored = list(f.keys())
    # every name below as the model's class names it: the readers rename a DeepSeek-V4 checkpoint saved under the
    # release's names (test_release_named_checkpoints_read_as_transformers_names checks the renaming itself)
    named = quantized_release_names(config, stored) or (lambda name: name)
    reference = {named(name): w for name, w in load_file(str(fixture / "reference.safetensors")).items()}
    pair, packed = PAIRS[FIXTURES[kind].split("_")[0]]
    quantized = {named(n[: -len(packed)] + ".weight") for n in stored if n.endswith(packed)}
    assert set(reference) == quantized
    projections = {named(n[: -len(packed)] + ".weight") if n.endswith(packed) else named(n) for n in stored}
    projections = {n for n in projections if PROJECTION.match(n)}
    excused = LEFT_IN_FLOAT_BY_PRODUCER.get(kind, re.compile(r"(?!)"))
    assert projections - quantized == {n for n in projections if NOT_QUANTIZED.search(n) or excused.search(n)}

    out = tmp_path / "q4_0.gguf"
    report = tmp_path / "report.json"
    run_cli(pair, fixture / "model", out, "--report", report)
    results = {t["name"]: t for t in json.loads(report.read_text())["tensors"]}
    for name in reference:
        for piece in _pieces(name):
            t = results[piece]
            want = "F32" if any(f".{d}." in piece for d in DEQUANTIZED) else "Q4_0"
            assert (t["target"], t["verdict"], t["max_abs_err"]) == (want, "exact", 0), t
    for name in projections - quantized:  # what the producer left in float is written as it is
        assert results[name]["verdict"] == "exact", results[name]

    if "kv_lora_rank" in config:
        _check_mla_halves(out, config)

    hf = tmp_path / "hf"
    run_cli("gguf->hf", out, hf, "--type", "f32")
    back = load_file(str(hf / "model.safetensors"))
    for name, want in reference.items():
        # read back under the name the model's class loads (llm-compressor's MiniMax-M2 experts.E.gate_proj is
        # the release's experts.E.w1: model_shapes.canonical_name); the producers multiply in fp16: equal once the
        # exact fp32 product is rounded to fp16. A reference may hold a module's first rows only (DeepSeek-V4's
        # indexer wq_b: the fixture's size)
        transposed = config.get("model_type") in TRANSPOSED_EXPERTS
        got = _read_back(back, canonical_name(name, config), transposed).to(torch.float16)
        assert want.shape[0] == min(got.shape[0], 256) or want.shape == got.shape, name
        assert torch.equal(got[: want.shape[0]], want), name

    got = llama_logits(out, PROMPT)
    if not (fixture / "logits.safetensors").exists():  # the producer's runtime does not run it (FLOAT_BASE_MEAN)
        want = llama_logits(_float_base_f32(kind), PROMPT)
        assert np.abs(got - want).mean() < FLOAT_BASE_MEAN, float(np.abs(got - want).mean())
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= FLOAT_BASE_TOP1
        return
    # the producer's runtime on its checkpoint, stored by the producer for the architecture tests' prompt
    produced = load_file(str(fixture / "logits.safetensors"))
    assert produced["prompt"].tolist() == PROMPT
    want = produced["logits"].numpy()
    assert np.abs(got - want).mean() < MEAN_TOLERANCE.get(kind, 0.05), float(np.abs(got - want).mean())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def _float_base_f32(kind: str) -> Path:
    """`hf->gguf --type f32` of the float base a fixture was quantized from (its versions.json's `base`: DeepSeek-V4's
    3 layers in the release's names, experts decoded), built once under tests/_fixtures/archs."""
    from gguf_arch_files import cached

    base = json.loads((PRODUCER_FIXTURES / FIXTURES[kind] / "versions.json").read_text())["base"]
    assert base.startswith("tests/support/fixtures_archs.py deepseek_v4 (seed 0, layers 3,"), base
    root = PRODUCER_FIXTURES.parent / "_fixtures" / "archs"
    release = cached(root / "dsv4-release-3", lambda d: fixtures_archs.build_deepseek_v4(d, layers=3))
    dense = cached(root / "dsv4-release-3-dequantized", lambda d: fixtures_archs.deepseek_v4_dequantized(release, d))
    return cached(root / "dsv4-release-3-dequantized-f32.gguf", lambda out: run_cli("hf->gguf", dense, out, "--type", "f32"))


def test_release_named_checkpoints_read_as_transformers_names():
    """llm-compressor's and auto-round's DeepSeek-V4 checkpoints keep the release's names (auto-round's all of them,
    llm-compressor's under `model.`, beside a few of transformers'); the readers give every tensor the name it has in
    gptqmodel's checkpoint of the same base, which gptqmodel saved from transformers' model: the quantized modules'
    `<module>.weight`, every float tensor, the stored name kept as the record's source_name. (auto-round keeps the
    hash-routed layer's unused router bias, which transformers drops on loading, under transformers' name for it.)"""
    from qconvert.converters.registry import get_format

    def names(folder: str) -> dict[str, str]:
        reader = get_format(PAIRS[folder.split("_")[0]][0].split("->")[0]).open_reader
        return {r.name: r.source_name or r.name for r in reader(PRODUCER_FIXTURES / folder / "model").records()}

    transformers_names = set(names("gptq_deepseek_v4"))
    for folder in ("ct_deepseek_v4", "autoround_deepseek_v4"):
        read = names(folder)
        extra = {"model.layers.0.mlp.gate.e_score_correction_bias"} if folder.startswith("autoround") else set()
        assert set(read) == transformers_names | extra, (folder, sorted(set(read) ^ transformers_names)[:6])
        assert read["lm_head.weight"] == "head.weight"
        assert read["model.layers.1.self_attn.q_a_proj.weight"] == \
            ("model." if folder.startswith("ct") else "") + "layers.1.attn.wq_a.weight"


def _check_mla_halves(path: Path, config: dict) -> None:
    """kv_b_proj's halves in the file as llama.cpp's deepseek2 / glm-dsa loaders create them (ggml order):
    attn_k_b {nope, kv_lora, heads} as F32, attn_v_b {kv_lora, v, heads} as Q4_0 (its rows are whole blocks of
    the grid's groups), in every layer the file holds."""
    import gguf

    heads, nope, v, rank = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim",
                                                "kv_lora_rank"))
    want = {"attn_k_b": ("F32", [nope, rank, heads]), "attn_v_b": ("Q4_0", [rank, v, heads])}
    found = {"attn_k_b": 0, "attn_v_b": 0}
    for t in gguf.GGUFReader(str(path)).tensors:
        half = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if half in want:
            assert (t.tensor_type.name, [int(d) for d in t.shape]) == want[half], t.name
            found[half] += 1
    assert found["attn_k_b"] == found["attn_v_b"] >= config["num_hidden_layers"], found


def test_value_half_is_dequantized_where_its_target_would_not_hold_the_grid(tmp_path):
    """v_b keeps its codes only where the target holds the grid exactly; elsewhere (here F16, whose rounding is
    near-exact) it is written as the exact float32 dequantization every split half was before, while the
    model's other grids take the type asked for."""
    fixture = PRODUCER_FIXTURES / FIXTURES["deepseek_v3"] / "model"
    report = tmp_path / "report.json"
    run_cli("gptq->gguf", fixture, tmp_path / "f16.gguf", "--type", "f16", "--report", report)
    results = {t["name"]: t for t in json.loads(report.read_text())["tensors"]}
    halves = [t for name, t in results.items() if name.endswith(".self_attn.v_b_proj.weight")]
    assert len(halves) == 2
    for t in halves:
        assert (t["source"], t["target"], t["verdict"], t["max_abs_err"]) == ("4-bit g32 sym", "F32", "exact", 0), t
        assert "as F16 would not hold its grid exactly" in t["reason"], t
    assert results["model.layers.0.self_attn.q_b_proj.weight"]["target"] == "F16"


def test_out_proj_reorder_keeps_groups_only_when_whole():
    """The value-head column reorder keeps a grid only when it moves whole groups in order: heads of 32 columns
    over groups of 32 do (the groups' scales follow); heads of 16 columns over groups of 32 split groups, and an
    act-order index scatters them, so those are dequantized (formats/gguf/archs/qwen35.py)."""
    from qconvert.converters.records import Grid, GridParams
    from qconvert.formats.gguf.archs.qwen35 import _swap_heads

    gen = torch.Generator().manual_seed(0)
    rows, heads_k, per_k = 3, 2, 2

    def grid(head: int, g_idx=None) -> Grid:
        cols = heads_k * per_k * head
        params = GridParams(bits=4, group_size=32, scales=torch.rand(rows, cols // 32, generator=gen) + 0.1,
                            zeros=torch.full((rows, cols // 32), 8, dtype=torch.int32), g_idx=g_idx)
        return Grid(params, torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8))

    whole = grid(32)
    columns = _swap_heads(torch.arange(128)[None], 1, heads_k, per_k, 32)[0]
    order = whole.params.whole_group_order(columns)
    assert order.tolist() == [0, 2, 1, 3]
    moved = whole.permute_columns(columns, order)
    assert torch.equal(moved.dequantize(), whole.dequantize()[:, columns])

    split = grid(16)
    assert split.params.whole_group_order(_swap_heads(torch.arange(64)[None], 1, heads_k, per_k, 16)[0]) is None
    act_order = grid(32, g_idx=torch.randperm(128, generator=gen) // 32)
    assert act_order.params.whole_group_order(columns) is None


@pytest.mark.parametrize("folder, key, module", [
    ("ct_deepseek_v4", "ignore", "model.layers.1.attn.wq_a"),  # as llm-compressor writes its ignore list
    ("ct_deepseek_v4", "ignore", "model.layers.1.self_attn.q_a_proj"),
    ("autoround_deepseek_v4", "extra_config", "layers.1.attn.wq_a"),  # as auto-round writes its extra_config
    ("autoround_deepseek_v4", "extra_config", "model.layers.1.self_attn.q_a_proj")])
def test_release_named_config_entries_match_either_name(folder, key, module, tmp_path):
    """A renamed checkpoint's quantization config names its modules as its producer saw them: an ignore list or a
    per-layer override is matched under the stored name and under transformers' (here: a quantized module said to be
    ignored, or kept 16-bit, is refused, naming its stored tensor)."""
    import shutil

    from qconvert.converters.errors import BadInput
    from qconvert.converters.registry import get_format

    src = tmp_path / "model"
    shutil.copytree(PRODUCER_FIXTURES / folder / "model", src)
    config_file = src / ("config.json" if key == "ignore" else "quantization_config.json")
    config = json.loads(config_file.read_text())
    qc = config["quantization_config"] if key == "ignore" else config
    if key == "ignore":
        qc["ignore"].append(module)
    else:
        qc["extra_config"][module] = {"bits": 16, "data_type": "float"}
    config_file.write_text(json.dumps(config))
    if key == "extra_config":  # auto-round's loader reads config.json's copy first
        (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                     "quantization_config": qc}))
    with pytest.raises(BadInput, match="ignore list|config says 16-bit") as e:
        list(get_format(PAIRS[folder.split("_")[0]][0].split("->")[0]).open_reader(src).records())
    assert "attn.wq_a." in str(e.value), str(e.value)


@pytest.mark.parametrize("folder", ["autoround_deepseek_v4", "ct_deepseek_v4"])
def test_a_renamed_tensor_of_the_wrong_shape_is_named_as_the_file_holds_it(tmp_path, folder):
    """A shape error in a renamed checkpoint names the tensor as the file stores it, then as it is read
    (auto-round's and llm-compressor's DeepSeek-V4 with a head one row short): the user looks for `head.weight`, not
    `lm_head.weight`."""
    import shutil

    from helpers import edit_safetensors
    from qconvert.converters.errors import BadInput
    from qconvert.converters.registry import get_format

    src = tmp_path / "model"
    shutil.copytree(PRODUCER_FIXTURES / folder / "model", src)
    shard = next(src.glob("*.safetensors"))
    edit_safetensors(shard, lambda t: t.__setitem__("head.weight", t["head.weight"][:-1].clone()))
    with pytest.raises(BadInput) as e:
        list(get_format(PAIRS[folder.split("_")[0]][0].split("->")[0]).open_reader(src).records())
    assert "tensor head.weight (read as lm_head.weight)" in str(e.value) and "does not match config.json" in str(
        e.value), str(e.value)
