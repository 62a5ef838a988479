"""DeepSeek-V4 (formats/gguf/archs/deepseek4.py) as llama.cpp's `deepseek4`, judged by llama.cpp itself on a tiny
random checkpoint in the release's layout (tests/support/fixtures_archs.py build_deepseek_v4: transformers'
DeepseekV4ForCausalLM seeded, saved under DeepSeek's names with MXFP4 experts, the only form llama.cpp's converter
reads; a sliding-only, a CSA (ratio 4, with the indexer) and an HCA (ratio 128) layer, 4 hyper-connection
streams, a hash-routed first layer):

- the arch-local name and key tables equal the constants of the gguf-py vendored in llama.cpp's sources (the
  installed gguf 0.19 does not name deepseek4), read in a child process, so that drift is caught;
- `hf->gguf --type f32` is what llama.cpp's own convert_hf_to_gguf.py writes for the same folder: every tensor's
  name, type (F32, the experts MXFP4 as released, tid2eid I32) and bytes, every `deepseek4.*` key with its type;
  the hash layer's router bias dropped as the converter drops it; llama.cpp's logits on our file equal those on
  the converter's file exactly;
- llama.cpp's logits follow transformers' DeepseekV4ForCausalLM on the same weights (the experts decoded), as
  far as llama.cpp's MXFP4 matmul allows (it quantizes the activations to Q8_0: mean 0.009, max 0.05 measured);
- a bfloat16 copy of the folder keeps its types as the converter keeps them (BF16 2-D tensors under `--type
  f32`, the router included), byte for byte, with the same logits;
- the full release's form (FP8 128x128-block linears, E8M0 exponents, quantization_config fp8) is the
  converter's file byte for byte with `--allow-requant` (its FP8 linears become Q8_0), and the same logits;
- `--type q8_0` and `--type q4_k_m` (256 wide, so the K types apply) equal llama-quantize's bytes of the F32
  file (with --allow-requantize: llama-quantize refuses to requantize the MXFP4 experts without it);
- `gguf->hf --type f32` of the F32 file loads in transformers as DeepseekV4ForCausalLM with the source's every
  parameter and buffer, bit for bit, and its logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fixtures_archs
from gguf_arch_files import cached as _cached
from helpers import gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).parents[2] / "_fixtures" / "archs"
PROMPT = fixtures_archs.arch_prompt()


def model_dir(wide: bool = False) -> Path:
    """The 4-layer model (sliding, CSA, HCA, CSA); wide: 2 layers (sliding, CSA), for the K types' rules."""
    return _cached(ROOT / ("dsv4-release" + ("-wide" if wide else "")),
                   lambda d: fixtures_archs.build_deepseek_v4(d, wide=wide, layers=2 if wide else 4))


def ours_f32(wide: bool = False) -> Path:
    """Our F32 file, its report.json beside it (`<name>.report.json`)."""
    src = model_dir(wide)
    return _cached(ROOT / f"{src.name}-f32.gguf", lambda out: run_cli(
        "hf->gguf", src, out, "--type", "f32", "--report", out.with_name(out.name + ".report.json")))


def bf16_dir() -> Path:
    return _cached(ROOT / "dsv4-release-bf16", lambda d: fixtures_archs.deepseek_v4_bf16(model_dir(), d))


def fp8_dir() -> Path:
    return _cached(ROOT / "dsv4-release-fp8", lambda d: fixtures_archs.deepseek_v4_fp8(bf16_dir(), d))


def reference_f32(folder: str = "dsv4-release") -> Path:
    """llama.cpp's converter's `--outtype f32` file of the float32 folder, or of its bfloat16 copy
    (`dsv4-release-bf16`), or of the FP8 release form (`dsv4-release-fp8`): the first call converts all three in
    one child process (torch imported once)."""
    import llama_cpp_reference as ref

    try:
        ref.llama_cpp_src()
    except FileNotFoundError as e:
        pytest.skip(f"llama.cpp's converter is not extracted: {e}")  # a failure under QCONVERT_REQUIRE_ORACLES
    jobs = [(model_dir(), ROOT / "dsv4-release-ref.gguf", "tiny deepseek4"),
            (bf16_dir(), ROOT / "dsv4-release-bf16-ref.gguf", "tiny deepseek4"),
            (fp8_dir(), ROOT / "dsv4-release-fp8-ref.gguf", "tiny deepseek4")]
    todo = [j for j in jobs if not j[1].with_name(j[1].name + ".done").exists()]
    for _, out, _ in todo:
        out.unlink(missing_ok=True)
    if todo:
        ref.convert_references(todo)
    for _, out, _ in todo:
        out.with_name(out.name + ".done").write_text("ok")
    return ROOT / f"{folder}-ref.gguf"


def _fields(path: Path) -> dict:
    """The deepseek4.* keys: (value, GGUF value types) each."""
    r = gguf.GGUFReader(str(path))
    return {k: (f.contents(), [int(t) for t in f.types]) for k, f in r.fields.items()
            if not k.startswith(("GGUF.", "general.", "tokenizer."))}


def _ne(shape, trim: bool) -> list[int]:
    ne = [int(d) for d in shape]
    while trim and len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return ne


def _same_tensors(ours: Path, theirs: Path, quantized: bool = False) -> set[str]:
    """Both files hold the same tensors, each of the same ggml type, shape and bytes; -> the types present."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert _ne(a[name].shape, quantized) == _ne(b[name].shape, quantized), name
        assert bytes(a[name].data) == bytes(b[name].data), name
    return {t.tensor_type.name for t in a.values()}


# the vendored gguf-py's constants, printed as JSON by a child process that imports it (never this process)
_VENDORED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import gguf
assert gguf.__file__.startswith(sys.argv[1]), gguf.__file__
arch = gguf.MODEL_ARCH.DEEPSEEK4
keys = {}
for path in sys.argv[2:]:
    group, attr = path.split(".")
    keys[path] = getattr(getattr(gguf.Keys, group), attr)
print(json.dumps({"arch": gguf.MODEL_ARCH_NAMES[arch],
                  "tensors": {t.name: gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]},
                  "keys": keys, "sqrtsoftplus": int(gguf.ExpertGatingFuncType.SQRTSOFTPLUS)}))
"""

# tensors of the vendored MODEL_TENSORS[DEEPSEEK4] the table leaves out, and why: the MTP block's (not
# converted, as llama.cpp's converter does by default) and the vision variant's image-token router bias
NOT_IN_TABLE = {"NEXTN_EH_PROJ", "NEXTN_EMBED_TOKENS", "NEXTN_ENORM", "NEXTN_HNORM", "NEXTN_SHARED_HEAD_HEAD",
                "NEXTN_SHARED_HEAD_NORM", "FFN_EXP_PROBS_B_VL"}


def test_name_and_key_tables_mirror_the_vendored_gguf_py():
    import llama_cpp_reference as ref
    from qconvert.formats.gguf.archs import arch_by_name
    from qconvert.formats.gguf.archs.deepseek4 import DEEPSEEK4_GATING, DEEPSEEK4_KEYS, DEEPSEEK4_TENSORS

    assert "deepseek4" not in gguf.MODEL_ARCH_NAMES.values()  # why the table exists (drop it when gguf has it)
    vendored = Path(ref.llama_cpp_src()) / "gguf-py"
    proc = subprocess.run([sys.executable, "-c", _VENDORED, str(vendored), *DEEPSEEK4_KEYS], capture_output=True,
                          text=True, check=True)
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["arch"] == arch_by_name("deepseek4").name
    for hf, (member, name) in DEEPSEEK4_TENSORS.items():
        base = name.rsplit(".", 1)[0]
        assert facts["tensors"][member].replace("{bid}", "0") == base, (hf, member)
    assert set(facts["tensors"]) - {m for m, _ in DEEPSEEK4_TENSORS.values()} == NOT_IN_TABLE
    assert facts["keys"] == DEEPSEEK4_KEYS
    assert facts["sqrtsoftplus"] == DEEPSEEK4_GATING["SQRTSOFTPLUS"]


def test_f32_is_what_llama_cpp_converter_writes_and_runs():
    ours, theirs = ours_f32(), reference_f32()
    assert _same_tensors(ours, theirs) == {"F32", "MXFP4", "I32"}
    assert _fields(ours) == _fields(theirs)
    fields = _fields(ours)
    assert fields["deepseek4.attention.compress_ratios"][0] == [0, 4, 128, 4]
    assert fields["deepseek4.hash_layer_count"][0] == 1
    assert gguf.GGUFReader(str(ours)).fields["general.architecture"].contents() == "deepseek4"
    a = gguf_tensors(ours)
    assert "blk.0.ffn_gate_tid2eid.weight" in a and "blk.0.exp_probs_b.bias" not in a
    assert "blk.1.exp_probs_b.bias" in a and "blk.1.indexer.attn_q_b.weight" in a
    assert "blk.2.attn_compressor_kv.weight" in a and "blk.2.indexer.attn_q_b.weight" not in a

    got = llama_logits(ours, PROMPT)
    assert np.array_equal(got, llama_logits(theirs, PROMPT))
    assert got.std(axis=-1).min() > 0.3  # far from uniform: a wrong weight would show

    # what was dropped, and the experts kept as their MXFP4 codes
    rows = json.loads(ours.with_name(ours.name + ".report.json").read_text())["tensors"]
    assert [t["name"] for t in rows if t["target"] == "dropped"] == ["model.layers.0.mlp.gate.e_score_correction_bias"]
    experts = [t for t in rows if ".mlp.experts." in t["name"]]
    assert len(experts) == 4 * 3 * 4 and all(t["target"] == "MXFP4" and t["verdict"] == "exact" for t in experts)


def test_bf16_folder_keeps_its_types_as_llama_cpp_converter_does(tmp_path):
    """The release stores its dense tensors in bfloat16: llama.cpp's converter keeps each stored type whatever
    --outtype says (BF16 for the 2-D ones, the router included; F32 for the 1-D ones; MXFP4 experts), and so
    does `--type f32` here, byte for byte, with the same logits."""
    ours = tmp_path / "bf16.gguf"
    run_cli("hf->gguf", bf16_dir(), ours, "--type", "f32")
    theirs = reference_f32("dsv4-release-bf16")
    assert _same_tensors(ours, theirs) == {"BF16", "F32", "MXFP4", "I32"}
    assert _fields(ours) == _fields(theirs)
    a = gguf_tensors(ours)
    assert a["blk.1.ffn_gate_inp.weight"].tensor_type.name == "BF16" and a["blk.1.attn_norm.weight"].tensor_type.name == "F32"
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


def test_release_fp8_form_is_what_llama_cpp_converter_writes(tmp_path):
    """The full release's form (FP8 E4M3 linears with an E8M0 exponent per 128x128 block, MXFP4 experts, the rest
    bfloat16): llama.cpp's converter dequantizes the FP8 blocks and writes them Q8_0 whatever --outtype says,
    which is a requantization here (refused without --allow-requant, naming the aligned choice); with it, the
    same file byte for byte and the same logits."""
    from qconvert.converters.registry import detect_format

    assert detect_format(fp8_dir()) == "hf"  # not the fp8 reader, which knows DeepSeek-V3's weight_scale_inv
    refused = tmp_path / "refused.gguf"
    proc = run_cli("hf->gguf", fp8_dir(), refused, "--type", "f32", check_rc=2)
    assert "requant" in proc.stderr and not refused.exists()
    ours = tmp_path / "fp8.gguf"
    run_cli("hf->gguf", fp8_dir(), ours, "--type", "f32", "--allow-requant")
    theirs = reference_f32("dsv4-release-fp8")
    assert _same_tensors(ours, theirs) == {"Q8_0", "BF16", "F32", "MXFP4", "I32"}
    assert _fields(ours) == _fields(theirs)
    a = gguf_tensors(ours)
    assert a["blk.1.attn_q_a.weight"].tensor_type.name == "Q8_0" and a["blk.1.ffn_gate_inp.weight"].tensor_type.name == "BF16"
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


def test_q8_0_equals_llama_quantize(tmp_path):
    ours = tmp_path / "ours-q8_0.gguf"
    run_cli("hf->gguf", model_dir(), ours, "--type", "q8_0", "--allow-requant")
    theirs = llama_quantize(ours_f32(), tmp_path / "llama-q8_0.gguf", 7, allow_requantize=True)
    assert {"Q8_0", "F32", "I32"} == _same_tensors(ours, theirs, quantized=True)
    a = gguf_tensors(ours)
    assert all(a[n].tensor_type.name == "Q8_0" for n in a if n.endswith("_exps.weight"))
    assert np.array_equal(llama_logits(ours, PROMPT), llama_logits(theirs, PROMPT))


def test_q4_k_m_equals_llama_quantize(tmp_path):
    ours = tmp_path / "ours-q4_k_m.gguf"
    run_cli("hf->gguf", model_dir(wide=True), ours, "--type", "q4_k_m", "--allow-requant")
    theirs = llama_quantize(ours_f32(wide=True), tmp_path / "llama-q4_k_m.gguf", 15, allow_requantize=True)
    assert {"Q4_K", "Q6_K"} <= _same_tensors(ours, theirs, quantized=True)
    assert gguf.GGUFReader(str(ours)).fields["general.file_type"].contents() == 15


def dequantized_dir() -> Path:
    return _cached(ROOT / "dsv4-release-dequantized",
                   lambda d: fixtures_archs.deepseek_v4_dequantized(model_dir(), d))


@pytest.fixture(scope="module")
def source_model():
    """transformers' DeepseekV4ForCausalLM of the source's weights (experts decoded): (state dict, logits),
    loaded once for the tests below."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dequantized_dir()), dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float().numpy()
    return model.state_dict(), logits


def test_llama_cpp_follows_transformers(source_model):
    want = source_model[1]
    got = llama_logits(ours_f32(), PROMPT)
    assert want.std(axis=-1).min() > 0.3
    assert np.abs(got - want).mean() < 0.02, float(np.abs(got - want).mean())
    assert np.abs(got - want).max() < 0.2, float(np.abs(got - want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_gguf_to_hf_gives_back_the_source_model(source_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    run_cli("gguf->hf", ours_f32(), out, "--type", "f32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    source = json.loads((model_dir() / "config.json").read_text())
    assert {k: config[k] for k in source} == source
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    assert type(back).__name__ == "DeepseekV4ForCausalLM"
    want, got = source_model[0], back.state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # the same parameters: the logits agree to float32 rounding (1.2e-6 measured; transformers fuses the source's
    # per-expert tensors itself, and the two runs need not sum alike)
    with torch.no_grad():
        logits = back(torch.tensor([PROMPT])).logits[0].float().numpy()
    assert np.abs(logits - source_model[1]).max() < 1e-5, float(np.abs(logits - source_model[1]).max())



@pytest.mark.parametrize("change, words", [({"compress_ratios": [0, 4, 64, 4]}, "compress_ratios"),
                                           ({"hc_mult": 2}, "hc_mult 2"),
                                           ({"scoring_func": "softmax"}, "scoring_func 'softmax'")])
def test_what_llama_cpp_does_not_run_is_refused_naming_the_key(change, words):
    """llama.cpp's deepseek4 runs compress ratios 0, 4 and 128, 4 hyper-connection streams and sqrtsoftplus
    routing only: another value is a BadInput naming config.json's key (the CLI's one line, exit 2, nothing
    written, as every BadInput), raised while the metadata is written, before any tensor."""
    from qconvert.converters.errors import BadInput
    from qconvert.formats.gguf.archs import arch_by_name

    config = {**json.loads((model_dir() / "config.json").read_text()), **change}
    writer = gguf.GGUFWriter(path=None, arch="deepseek4")
    with pytest.raises(BadInput, match=words):
        arch_by_name("deepseek4").extra_metadata(writer, config)
