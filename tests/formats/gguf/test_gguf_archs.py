"""GGUF for the model families beyond llama / qwen2 / qwen3: mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3,
phi3 (Phi-4 style: byte-level BPE), deepseek_v3 and gpt_oss (dense float experts), judged by llama.cpp itself:

- `hf->gguf --type f32` of a tiny random model of each family gives the tensors (names, types, bytes) and
  the model metadata that llama.cpp's own convert_hf_to_gguf.py writes for it (the llama-cpp-python sdist's
  copy, scripts/llama_cpp_reference.py), and llama.cpp runs it within 0.05 of transformers' logits; for
  DeepSeek-V3, where llama.cpp and transformers part on details, within 1e-3 of llama.cpp running the
  converter's own file; gpt-oss (sinks, biased router and experts, fused transposed interleaved experts,
  sliding/full layers, YaRN) with exactly the logits llama.cpp gives on the converter's file, and those within
  1e-4 of transformers';
- `--type q8_0` equals llama-quantize's Q8_0 of our F32 file, tensor by tensor, and runs with its logits;
- `gguf->hf --type f32` of the F32 file loads in transformers as the source's class with its logits (1e-4);
- gptqmodel-quantized Qwen3-MoE and Mixtral: `gptq->gguf` keeps every expert's codes (Q4_0, max error 0
  against gptqmodel's dequantization, expert by expert) and llama.cpp runs the file;
- a MoE whose experts span several shards converts within 2x the largest shard of memory;
- gpt-oss's own YaRN `truncate: false` (which llama.cpp cannot honour) is warned about and measured; a
  `layer_types` other than llama.cpp's alternation is written as a sliding_window_pattern that llama.cpp
  runs as transformers does; the GGUF llama.cpp's converter makes from gpt-oss's MXFP4 checkpoint form
  reads back (`gguf->hf`) with transformers' own dequantization of the blocks, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from gguf_arch_files import ROOT, assert_same_model_keys, cached, converter, model_keys, same_tensors
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

SUPPORT = Path(__file__).parents[2] / "support"  # the shared test modules, for the children below
KINDS = fixtures_archs.KINDS
PROMPT = fixtures_archs.arch_prompt()
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
# metadata llama.cpp's converter does not write but we do: gemma2's rope base (the config's; llama.cpp's
# default is the same 10000)
EXTRA_KEYS = {"gemma2": {"gemma2.rope.freq_base"}}


# the fixture cache, the converter and the file comparisons every architecture test shares (tests/support); the
# names below are this module's own (test_gguf_archs_*.py once imported them from here)
_cached, _reference_module, _model_keys = cached, converter, model_keys
_assert_same_model_keys = assert_same_model_keys


def model_dir(kind: str) -> Path:
    return _cached(ROOT / kind, lambda d: fixtures_archs.build_arch_model(d, kind))


def ours_f32(kind: str) -> Path:
    src = model_dir(kind)
    return _cached(ROOT / f"{kind}-f32.gguf", lambda out: run_cli("hf->gguf", src, out, "--type", "f32"))


def reference_f32(kind: str) -> Path:
    ref = converter()
    src = model_dir(kind)
    # general.name must not say "phi3": llama.cpp then wants Phi-3's SentencePiece tokens (see the script)
    return _cached(ROOT / f"{kind}-ref.gguf",
                   lambda out: ref.convert_reference(src, out, model_name="tiny " + kind.replace("phi3", "phi-4")))


@pytest.mark.parametrize("kind", KINDS)
def test_f32_is_what_llama_cpp_converter_writes_and_runs(kind):
    ours, theirs = ours_f32(kind), reference_f32(kind)
    same_tensors(ours, theirs)  # names, types, shapes, bytes
    a = gguf_tensors(ours)
    _assert_same_model_keys(ours, theirs, EXTRA_KEYS.get(kind, set()))
    stacked = [n for n in a if n.endswith("_exps.weight")]
    assert bool(stacked) == (kind in MOE_KINDS)

    got = llama_logits(ours, PROMPT)
    if kind == "deepseek_v3":
        want = llama_logits(theirs, PROMPT)
        assert np.abs(got - want).max() < 1e-3
    else:
        if kind == "gpt_oss":  # the same tensors and keys: llama.cpp computes the very same logits
            assert np.array_equal(got, llama_logits(theirs, PROMPT))
            assert {"blk.1.attn_sinks.weight", "blk.1.ffn_gate_inp.bias", "blk.1.ffn_gate_exps.bias",
                    "blk.1.ffn_up_exps.bias", "blk.1.ffn_down_exps.bias", "blk.1.post_attention_norm.weight"} <= set(a)
        want = fixtures_archs.transformers_logits(model_dir(kind), PROMPT)
        assert np.abs(got - want).max() < 0.05, float(np.abs(got - want).max())
        if kind == "gpt_oss":  # float32 both sides, nothing either approximates (measured 4e-6)
            assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())
    assert want.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def _same_tensors(ours: Path, theirs: Path) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type and bytes; -> the types present."""
    return same_tensors(ours, theirs, shapes=False)


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_equals_llama_quantize(kind, tmp_path):
    f32 = ours_f32(kind)
    ours = tmp_path / "ours-q8_0.gguf"
    run_cli("hf->gguf", model_dir(kind), ours, "--type", "q8_0", "--allow-requant")
    theirs = llama_quantize(f32, tmp_path / "llama-q8_0.gguf", 7)
    assert "Q8_0" in _same_tensors(ours, theirs)
    a = gguf_tensors(ours)
    if kind in MOE_KINDS:  # routers stay F32, experts quantized
        routers = [n for n in a if n.endswith("ffn_gate_inp.weight")]
        assert routers and all(a[n].tensor_type.name == "F32" for n in routers)
        assert all(a[n].tensor_type.name == "Q8_0" for n in a if n.endswith("_exps.weight"))
        # gpt-oss's per-expert biases are 2-D but not .weight: llama-quantize leaves them F32
        assert all(a[n].tensor_type.name == "F32" for n in a if n.endswith("_exps.bias"))
        assert any(n.endswith("_exps.bias") for n in a) == (kind == "gpt_oss")
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


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
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())


# -- quantized MoE sources ----------------------------------------------------------------------------
def _gguf_expert_rows(path: Path) -> dict[tuple[str, int], np.ndarray]:
    """Each expert's dequantized [out, in] rows from the stacked GGUF tensors, by (GGUF name, expert)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # [experts, out, in]
        for e in range(values.shape[0]):
            out[(t.name, e)] = np.asarray(values[e], dtype=np.float32)
    return out


def _stack_slot(hf_name: str, arch: str) -> tuple[str, int]:
    """Where an HF expert weight goes in a GGUF: (stacked tensor, expert index). gptqmodel saves Mixtral's
    experts under Qwen-style names (mlp.experts.E.gate_proj), which map to the same stacks."""
    from qconvert.formats.gguf.names import expert_of, gguf_tensor_name

    return gguf_tensor_name(hf_name, arch, 1 << 10), expert_of(hf_name)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_gptqmodel_moe_to_gguf_keeps_every_expert(kind, tmp_path):
    import fixtures_moe

    ckpt = fixtures_moe.ensure_moe_gptq(kind=kind)
    out = tmp_path / "moe-q4_0.gguf"
    report = tmp_path / "report.json"
    run_cli("gptq->gguf", ckpt, out, "--report", report)
    results = json.loads(report.read_text())["tensors"]
    experts = [t for t in results if ".experts." in t["name"]]
    assert len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x gate/up/down
    assert all(t["target"] == "Q4_0" and t["verdict"] == "exact" and t["max_abs_err"] == 0 for t in experts)

    reference = fixtures_moe.moe_gptq_reference_in_child(ckpt, tmp_path / "reference.pt")
    rows = _gguf_expert_rows(out)
    arch = gguf.GGUFReader(str(out)).fields["general.architecture"].contents()
    slots = {_stack_slot(n, arch): n for n in reference if ".experts." in n}
    assert set(rows) == set(slots)
    for slot, values in rows.items():
        # gptqmodel multiplies in fp16: equal once the exact fp32 product is rounded to fp16
        want = reference[slots[slot]].to(torch.float16)
        assert torch.equal(torch.from_numpy(values).to(torch.float16), want), slot

    # llama.cpp runs it. The weights the file holds, read back (gguf->hf) and run by transformers, are what
    # llama.cpp computes with them in F32 (1e-4); the Q4_0 file itself runs with llama.cpp's activation
    # quantization (Q8_0 activations against Q4_0 weights), whose noise can flip a top-2 routing choice:
    # judged on the mean and on top-1 agreement
    hf = tmp_path / "hf"
    run_cli("gguf->hf", out, hf, "--type", "f32")
    f32 = tmp_path / "same-weights-f32.gguf"
    run_cli("hf->gguf", hf, f32, "--type", "f32")
    want = fixtures_archs.transformers_logits(hf, PROMPT)
    assert np.abs(llama_logits(f32, PROMPT) - want).max() < 1e-4
    # gptq->hf gives the same model: gptqmodel's Mixtral names (mlp.experts.E.gate_proj) are written under
    # the names transformers' Mixtral loads (block_sparse_moe.experts.E.w1), else its experts stay random
    direct = tmp_path / "gptq-hf"
    run_cli("gptq->hf", ckpt, direct, "--type", "f32")
    assert np.array_equal(fixtures_archs.transformers_logits(direct, PROMPT), want)
    # and verify matches the renamed experts with the source's (every tensor exact, none missing)
    run_cli("verify", ckpt, direct, "--report", tmp_path / "verify.json")
    summary = json.loads((tmp_path / "verify.json").read_text())["summary"]
    assert summary["verdicts"].get("exact") == summary["tensors"] == len(results)
    got = llama_logits(out, PROMPT)
    assert np.abs(got - want).mean() < 0.05, float(np.abs(got - want).mean())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


# -- memory: experts spread over several shards --------------------------------------------------------
PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out, warm = map(Path, sys.argv[1:4])
    convert("hf", warm, "gguf", out.with_name("warmup.gguf"), Options(type="q8_0", allow_requant=True), progress=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = convert("hf", src, "gguf", out, Options(type="q8_0", allow_requant=True), progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "verdicts": report.summary()["verdicts"]}))
""")


def _big_moe(out: Path) -> Path:
    """A Qwen3-MoE with 32 experts of 512 x 1024 per layer (200 MB of fp32 experts a layer), saved in shards
    of 48 MB so that every layer's experts span several shards."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=1024,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         num_experts=32, num_local_experts=32, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(str(out), max_shard_size="48MB")
    import fixtures

    fixtures.build_tokenizer(out)
    return out


def _big_moe_in_a_child(out: Path) -> None:
    code = ("import sys; sys.path[:0] = sys.argv[2:]; import test_gguf_archs as t; "
            "t._big_moe(__import__('pathlib').Path(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out), str(Path(__file__).parent), str(SUPPORT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_moe_experts_across_shards_stay_within_twice_the_largest_shard(tmp_path):
    src = _cached(ROOT / "moe_sharded", _big_moe_in_a_child)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) >= 6
    with open(src / "model.safetensors.index.json") as f:
        where = json.load(f)["weight_map"]
    layer0 = {where[n] for n in where if n.startswith("model.layers.0.mlp.experts.")}
    assert len(layer0) >= 2  # one layer's experts are spread over several shards
    largest = max(p.stat().st_size for p in shards)
    out = tmp_path / "out.gguf"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(src), str(out), str(model_dir("qwen3_moe"))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = result["peak"] - result["base"]
    assert grown < 2 * largest, (grown / 1e6, largest / 1e6)
    r = gguf.GGUFReader(str(out))
    stacks = [t for t in r.tensors if t.name.endswith("_exps.weight")]
    assert len(stacks) == 3 * 3 and all(list(t.shape)[-1] == 32 for t in stacks)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3", "phi3", "gemma3", "gpt_oss"])
def test_q4_k_m_equals_llama_quantize(kind, tmp_path):
    """llama-quantize's Q4_K_M mix on the new families, end to end: every tensor's type and bytes as
    llama_model_quantize gives from our F32 file (models 256 wide, so the K types apply; the expert,
    MLA and fused-projection rules of formats/gguf/presets.py decide)."""
    src = _cached(ROOT / f"{kind}-wide", lambda d: fixtures_archs.build_arch_model(d, kind, wide=True))
    f32 = tmp_path / "f32.gguf"
    run_cli("hf->gguf", src, f32, "--type", "f32")
    ours = tmp_path / "ours-q4_k_m.gguf"
    run_cli("hf->gguf", src, ours, "--type", "q4_k_m", "--allow-requant")
    theirs = llama_quantize(f32, tmp_path / "llama-q4_k_m.gguf", 15)
    assert {"Q4_K", "Q6_K"} <= _same_tensors(ours, theirs)
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == 15


def _phi3_longrope(out: Path) -> Path:
    """Phi-3 with longrope (the 128k models' scaling): its long and short factor tables, context 1024 over an
    original 256 (llama.cpp and transformers both take the short table within the original context)."""
    fixtures_archs.build_arch_model(out, "phi3")
    config = json.loads((out / "config.json").read_text())
    gen = np.random.default_rng(3)
    config.update(max_position_embeddings=1024, original_max_position_embeddings=256)
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 250000.0, "partial_rotary_factor": 1.0,
                                 "original_max_position_embeddings": 256,
                                 "long_factor": [float(x) for x in 1 + 3 * gen.random(16)],
                                 "short_factor": [float(x) for x in 1 + 0.5 * gen.random(16)]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_phi3_longrope_factors_travel_both_ways(tmp_path):
    src = _cached(ROOT / "phi3_longrope", _phi3_longrope)
    ours = tmp_path / "ours.gguf"
    run_cli("hf->gguf", src, ours, "--type", "f32")
    ref = converter()
    theirs = ref.convert_reference(src, tmp_path / "ref.gguf", model_name="tiny phi-4")
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b) and {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(a)
    assert all(bytes(a[n].data) == bytes(b[n].data) for n in a)
    _assert_same_model_keys(ours, theirs)
    want = fixtures_archs.transformers_logits(src, PROMPT)
    assert np.abs(llama_logits(ours, PROMPT) - want).max() < 0.05
    back = tmp_path / "hf"
    run_cli("gguf->hf", ours, back, "--type", "f32")
    rope = json.loads((back / "config.json").read_text())["rope_scaling"]
    assert rope["rope_type"] == "longrope" and len(rope["long_factor"]) == 16
    assert np.abs(fixtures_archs.transformers_logits(back, PROMPT) - want).max() < 1e-4


def test_moe_gguf_back_to_gptq_loads_in_gptqmodel(tmp_path):
    """The experts split back out of the stacks: gptq -> gguf -> gptq of gptqmodel's Qwen3-MoE loads in
    gptqmodel with the original checkpoint's logits exactly (the Q4_0 blocks hold the GPTQ words)."""
    import fixtures_moe

    ckpt = fixtures_moe.ensure_moe_gptq(kind="qwen3_moe")
    run_cli("gptq->gguf", ckpt, tmp_path / "moe.gguf")
    run_cli("gguf->gptq", tmp_path / "moe.gguf", tmp_path / "gptq")
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[3])
        import fixtures, fixtures_archs
        ids = torch.tensor([fixtures_archs.arch_prompt()])
        logits = []
        for d in sys.argv[1:3]:
            with torch.no_grad():
                logits.append(fixtures._load_quantized(d)(ids).logits[0].float())
        print(float((logits[0] - logits[1]).abs().max()), float(logits[0].std()))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt), str(tmp_path / "gptq"), str(SUPPORT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff, spread = map(float, proc.stdout.strip().splitlines()[-1].split())
    assert diff == 0.0 and spread > 0.3


def _fused_qwen3_moe(out: Path) -> Path:
    """The qwen3_moe fixture saved with its experts already fused, as transformers 5 holds them
    (mlp.experts.gate_up_proj [experts, 2 * ffn, hidden] gate rows first, mlp.experts.down_proj)."""
    from safetensors.torch import load_file, save_file

    src = model_dir("qwen3_moe")
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    n = config.get("num_experts") or config["num_local_experts"]
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                             tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(n)])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    save_file(fused, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_fused_experts_make_the_same_gguf(tmp_path):
    src = _cached(ROOT / "qwen3_moe_fused", _fused_qwen3_moe)
    # transformers reads the fused layout as the same model ...
    assert np.array_equal(fixtures_archs.transformers_logits(src, PROMPT),
                          fixtures_archs.transformers_logits(model_dir("qwen3_moe"), PROMPT))
    # ... and the GGUF is byte for byte the one the per-expert checkpoint makes
    out = tmp_path / "fused.gguf"
    run_cli("hf->gguf", src, out, "--type", "f32")
    assert _same_tensors(out, ours_f32("qwen3_moe")) == {"F32"}


def _gpt_oss_truncate_false(out: Path) -> Path:
    """The gpt_oss fixture with YaRN's truncate false, as gpt-oss's own configs have it."""
    shutil.copytree(model_dir("gpt_oss"), out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"]["truncate"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_gpt_oss_yarn_truncate_false(tmp_path):
    """gpt-oss ships YaRN with truncate false, which transformers honours (the correction range unrounded) and
    llama.cpp cannot (ggml_rope_yarn_corr_dims always floors/ceils it; no GGUF key says otherwise): the
    conversion names the difference, writes what llama.cpp's converter writes (the same file as with truncate
    true), and llama.cpp then runs the model as transformers does with truncate true. That is why the gpt_oss
    fixture sets truncate true: on it the difference is ~1.8 in the logits (correction range [0, 3.12]
    against [0, 4] of 16 rotated pairs)."""
    src = _cached(ROOT / "gpt_oss_truncate_false", _gpt_oss_truncate_false)
    out = tmp_path / "truncate-false.gguf"
    proc = run_cli("hf->gguf", src, out, "--type", "f32")
    assert "truncate is false" in proc.stderr
    assert _same_tensors(out, ours_f32("gpt_oss")) == {"F32"}
    _assert_same_model_keys(out, reference_f32("gpt_oss"))
    got = llama_logits(out, PROMPT)
    as_truncated = fixtures_archs.transformers_logits(model_dir("gpt_oss"), PROMPT)
    as_shipped = fixtures_archs.transformers_logits(src, PROMPT)
    assert np.abs(got - as_truncated).max() < 0.05
    assert np.abs(got - as_shipped).max() > 0.5, float(np.abs(got - as_shipped).max())


def test_gpt_oss_mxfp4_gguf_reads_back_as_transformers_dequantizes(tmp_path):
    """gpt-oss's MXFP4 checkpoint form (`*_blocks`/`*_scales` experts) through llama.cpp's converter gives a GGUF
    whose expert stacks are MXFP4 (general.file_type MOSTLY_MXFP4_MOE) and the rest as --outtype says;
    `gguf->hf` fuses the stacks back into gate_up_proj / down_proj equal bit for bit to transformers'
    dequantization of the same blocks (integrations/mxfp4.py), every other tensor unchanged, and llama.cpp's
    logits on the MXFP4 file follow transformers' on what we read (its MXFP4 matmul quantizes activations
    to Q8_0: judged on the mean and top-1, as the GPTQ MoE file is)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    src = _cached(ROOT / "gpt_oss_mxfp4", lambda d: fixtures_archs.gpt_oss_mxfp4_checkpoint(model_dir("gpt_oss"), d))
    ref = converter()
    theirs = ref.convert_reference(src, tmp_path / "mxfp4.gguf", model_name="tiny gpt_oss")
    a = gguf_tensors(theirs)
    assert {n for n in a if a[n].tensor_type.name == "MXFP4"} == {n for n in a if n.endswith("_exps.weight")}
    assert gguf.GGUFReader(str(theirs)).fields["general.file_type"].contents() == 38
    back = tmp_path / "hf"
    run_cli("gguf->hf", theirs, back, "--type", "f32")
    assert json.loads((back / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    packed, read = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(read) == {n.removesuffix("_blocks") for n in packed if not n.endswith("_scales")}
    for name, t in read.items():
        want = (_convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"], dtype=torch.float32)
                if name + "_blocks" in packed else packed[name])
        assert torch.equal(t, want), name
    got, want = llama_logits(theirs, PROMPT), fixtures_archs.transformers_logits(back, PROMPT)
    assert np.abs(got - want).mean() < 0.05, float(np.abs(got - want).mean())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def _gpt_oss_full_first(out: Path) -> Path:
    """The gpt_oss fixture with its layer types swapped (full, sliding): not llama.cpp's default alternation."""
    shutil.copytree(model_dir("gpt_oss"), out)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_gpt_oss_other_layer_types_are_written_as_a_pattern(tmp_path):
    """llama.cpp's gpt-oss assumes sliding, full, ... unless the file has a per-layer sliding_window_pattern
    (load_swa_pattern), which its converter never writes: qconvert writes one when layer_types differ, and
    llama.cpp then runs the model as transformers does (the swap moves transformers' own logits by far more
    than the tolerance, so the window is exercised); gguf->hf reads the pattern back into layer_types."""
    src = _cached(ROOT / "gpt_oss_full_first", _gpt_oss_full_first)
    out = tmp_path / "full-first.gguf"
    run_cli("hf->gguf", src, out, "--type", "f32")
    fields = gguf.GGUFReader(str(out)).fields
    assert list(fields["gpt-oss.attention.sliding_window_pattern"].contents()) == [False, True]
    want = fixtures_archs.transformers_logits(src, PROMPT)
    assert np.abs(fixtures_archs.transformers_logits(model_dir("gpt_oss"), PROMPT) - want).max() > 0.1
    got = llama_logits(out, PROMPT)
    assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())
    back = tmp_path / "hf"
    run_cli("gguf->hf", out, back, "--type", "f32")
    assert json.loads((back / "config.json").read_text())["layer_types"] == ["full_attention", "sliding_attention"]
    assert np.abs(fixtures_archs.transformers_logits(back, PROMPT) - want).max() < 1e-4
