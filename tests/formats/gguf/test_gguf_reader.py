"""GGUF files made by llama.cpp itself -> our reader -> gguf / hf / gptq, checked against the real tools.

Producer: llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`, the C `llama-quantize`) run on an
F32 GGUF of a tiny random model 256 wide (so K types fit), for arch llama, qwen2 and qwen3.
Consumers and oracles: gguf-py's dequantization (every tensor, bit for bit), llama.cpp (logits of the
source and of split outputs), transformers (the `hf` output), gptqmodel (the `gptq` output).
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli, transformers_logits

from qconvert.converters.errors import BadInput, RefusedPlan
from qconvert.converters.plan import Options
from qconvert.converters.run import convert
from qconvert.formats.gguf.names import inverse_permutation, qk_row_permutation
from qconvert.formats.gguf.reader import GRID_TYPES, GgufSource

llama_cpp = pytest.importorskip("llama_cpp")

from gguf_reader_files import ARCHS, LLAMA_TYPES, OTHER_TYPES, _ensure  # noqa: E402  (needs llama_cpp)

LOGIT_TOLERANCE = 0.05  # quantized weights, as a fraction of the logit range
F32_LOGIT_TOLERANCE = 1e-4  # F32 GGUF vs transformers (F32 KV cache)
PROMPT = fixtures.prompt_ids()


@pytest.fixture(scope="module")
def made():
    return {arch: _ensure(arch) for arch in ARCHS}


def _cases():
    return [(a, t) for a in ARCHS for t in ["f32", *(LLAMA_TYPES if a == "llama" else OTHER_TYPES)]]


def _reference(src: GgufSource, rec) -> np.ndarray:
    """gguf-py's dequantization of the record's GGUF tensor, in HF layout (llama Q/K un-permuted)."""
    t = next(t for r in src.readers for t in r.tensors if t.name == rec.source_name)
    want = np.asarray(gguf_dequant(t), dtype=np.float32).reshape(rec.shape)
    perm = qk_row_permutation(rec.name, src.config, src.arch)
    return want if perm is None else want[inverse_permutation(perm).numpy()]


@pytest.mark.parametrize("arch,qtype", _cases())
def test_reader_equals_gguf_py(made, arch, qtype):
    """Every tensor's dequantization equals gguf-py's bit for bit; block types come as grids with their
    block bytes, in HF names and layout."""
    src = GgufSource(made[arch][qtype])
    seen = set()
    for rec in src.records():
        item = rec.load()
        got = item.dequantize(torch.float32).numpy()
        want = _reference(src, rec)
        assert got.shape == want.shape, rec.name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{rec.name} ({rec.native_type})"
        ggml_type = rec.native_type
        seen.add(ggml_type)
        if ggml_type in GRID_TYPES:
            assert rec.is_grid and item.packed.layout == f"ggml:{ggml_type}", rec.name
        else:
            assert not rec.is_grid and rec.dtype == {"F16": "float16", "BF16": "bfloat16"}.get(ggml_type, "float32")
    assert src.config["architectures"][0].lower().startswith(arch)
    expected = {"q4_0": {"Q4_0"}, "q8_0": {"Q8_0"}, "q4_k_m": {"Q4_K", "Q6_K"}, "q6_k": {"Q6_K"}, "q2_k": {"Q2_K", "Q3_K"},
                "q3_k_m": {"Q3_K", "Q4_K", "Q5_K"}, "q5_k_m": {"Q5_K"}, "q4_1": {"Q4_1"}, "q5_0": {"Q5_0"},
                "q5_1": {"Q5_1"}, "f32": {"F32"}, "f16": {"F16"}, "bf16": {"BF16"}, "iq4_nl": {"IQ4_NL"}}[qtype]
    assert expected <= seen, seen


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k_m", "q6_k"])
def test_gguf_to_gguf_same_type_is_byte_identical(made, tmp_path, qtype):
    src = made["llama"][qtype]
    out = tmp_path / "out.gguf"
    report = tmp_path / "r.json"
    run_cli("gguf->gguf", src, out, "--report", report)
    rep = json.loads(report.read_text())
    assert {t["verdict"] for t in rep["tensors"]} == {"exact"}
    assert rep["summary"]["max_abs_err"] == 0.0
    a, b = gguf_tensors(src), gguf_tensors(out)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.asarray(a[name].data).tobytes() == np.asarray(b[name].data).tobytes(), name
    # and llama.cpp computes the same thing from it
    assert np.array_equal(llama_logits(src, PROMPT), llama_logits(out, PROMPT))


def test_gguf_to_other_type_follows_the_plan(made, tmp_path):
    """Another target type is planned as usual: Q4_0 grids repack into Q8_0 exactly (codes kept), a
    Q6_K tensor can keep its type through --tensor-type, K grids into Q4_0 need --allow-requant."""
    src = made["llama"]["q4_0"]
    out = tmp_path / "q8.gguf"
    line = _fails("gguf->gguf", src, out, "--type", "q8_0")
    assert "lm_head.weight" in line and "--allow-requant" in line
    report = convert("gguf", src, "gguf", out, Options(type="q8_0", tensor_types=[("^lm_head", "q6_k")]),
                     progress=False)
    assert {r.plan.verdict for r in report.results} == {"exact"} and report.summary()["max_abs_err"] == 0.0
    a, b = gguf_tensors(src), gguf_tensors(out)
    for name in a:
        want = {"Q4_0": "Q8_0"}.get(a[name].tensor_type.name, a[name].tensor_type.name)
        assert b[name].tensor_type.name == want, name
        assert np.array_equal(gguf_dequant(a[name]), gguf_dequant(b[name])), name
    ours, theirs = llama_logits(out, PROMPT), llama_logits(src, PROMPT)
    assert float(np.abs(ours - theirs).max()) <= LOGIT_TOLERANCE * float(theirs.max() - theirs.min())
    with pytest.raises(RefusedPlan, match=r"requantization.*--type f32 \(exact\)"):
        convert("gguf", made["llama"]["q4_k_m"], "gguf", tmp_path / "q40.gguf", Options(type="q4_0"), progress=False)
    convert("gguf", made["llama"]["q4_k_m"], "gguf", tmp_path / "q40.gguf", Options(type="q4_0", allow_requant=True),
            progress=False)
    assert {t.tensor_type.name for t in gguf_tensors(tmp_path / "q40.gguf").values()} == {"Q4_0", "F32"}


def _hf_case(made, tmp_path, arch, qtype):
    src_path = made[arch][qtype]
    out = tmp_path / f"{arch}-{qtype}-hf"
    report = convert("gguf", src_path, "hf", out, Options(type="f32"), progress=False)
    assert all(r.max_abs_err == 0.0 for r in report.results)
    from safetensors.numpy import load_file

    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    src = GgufSource(src_path)
    for rec in src.records():
        assert np.array_equal(weights[rec.name], _reference(src, rec)), rec.name
    ours = transformers_logits(out, PROMPT)
    theirs = llama_logits(src_path, PROMPT)
    rng = float(theirs.max() - theirs.min())
    tol = F32_LOGIT_TOLERANCE if qtype == "f32" else LOGIT_TOLERANCE * rng
    assert float(np.abs(ours - theirs).max()) <= tol, (float(np.abs(ours - theirs).max()), rng)
    return out


@pytest.mark.parametrize("arch,qtype", [(a, t) for a in ARCHS for t in ("f32", "q4_0")]
                         + [("llama", t) for t in ("q8_0", "q4_k_m", "q6_k")])
def test_gguf_to_hf_loads_in_transformers(made, tmp_path, arch, qtype):
    """Weights equal gguf-py's dequantization (Q/K un-permuted); logits match llama.cpp on the source."""
    out = _hf_case(made, tmp_path, arch, qtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    llm = llama_cpp.Llama(str(made[arch][qtype]), n_ctx=64, vocab_only=True, verbose=False)
    try:
        text = "def main():\n    print('hello, world')\n"
        assert tok.encode(text, add_special_tokens=False) == llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_q4_0_to_gptq_loads_in_gptqmodel(made, tmp_path, arch):
    """A llama.cpp Q4_0 file becomes GPTQ 4-bit sym g32 with every code and fp16 scale kept: gptqmodel's
    own dequantized weights equal gguf-py's (in fp16), and its logits follow llama.cpp's."""
    if not fixtures.gptqmodel_available():
        pytest.skip("gptqmodel is not installed")
    src_path = made[arch]["q4_0"]
    out = tmp_path / "gptq"
    report = convert("gguf", src_path, "gptq", out, Options(), progress=False)
    linears = [r for r in report.results if r.plan.target.startswith("gptq")]
    assert len(linears) == 14 and all(r.plan.verdict == "exact" and r.max_abs_err == 0.0 for r in linears)
    qc = json.loads((out / "quantize_config.json").read_text())
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 32, True, False)
    ref = fixtures.gptq_reference(out, tmp_path / "ref.safetensors", PROMPT)
    weights, logits = fixtures.load_reference(ref)
    src = GgufSource(src_path)
    checked = 0
    for rec in src.records():
        module = rec.name[: -len(".weight")]
        if module in weights:
            want = _reference(src, rec).astype(np.float16)
            assert np.array_equal(weights[module], want), rec.name
            checked += 1
    assert checked == 14
    theirs = llama_logits(src_path, PROMPT)
    rng = float(theirs.max() - theirs.min())
    assert float(np.abs(logits[0] - theirs).max()) <= LOGIT_TOLERANCE * rng


def test_split_output_loads_in_llama_cpp(made, tmp_path):
    """--split-max-size writes -0000i-of-0000N parts that llama.cpp loads as one model, bit-identical
    logits; reading the set back (from any part) gives the source's tensors byte for byte."""
    src = made["llama"]["q4_0"]
    out = tmp_path / "model.gguf"
    run_cli("gguf->gguf", src, out, "--split-max-size", "300K")
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == ["model-00001-of-00003.gguf", "model-00002-of-00003.gguf", "model-00003-of-00003.gguf"]
    assert max((tmp_path / p).stat().st_size for p in parts) < 300_000 + 100_000  # header + one tensor over
    line = _fails("gguf->gguf", src, out, "--split-max-size", "300K")  # the parts exist: no silent overwrite
    assert "model-00001-of-00003.gguf" in line and "--force" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == parts  # and no temporary left behind
    first = tmp_path / parts[0]
    assert np.array_equal(llama_logits(first, PROMPT), llama_logits(src, PROMPT))
    back = tmp_path / "back" / "joined.gguf"
    run_cli("gguf->gguf", tmp_path / parts[1], back)
    a, b = gguf_tensors(src), gguf_tensors(back)
    assert a.keys() == b.keys()
    for name in a:
        assert np.asarray(a[name].data).tobytes() == np.asarray(b[name].data).tobytes(), name
    # a split output from an HF source too (f32 -> q8_0 parts), llama.cpp equal to the unsplit file
    one, many = tmp_path / "one" / "m.gguf", tmp_path / "many" / "m.gguf"
    run_cli("hf->gguf", made["qwen2"]["hf"], one, "--type", "q8_0", "--allow-requant")
    run_cli("hf->gguf", made["qwen2"]["hf"], many, "--type", "q8_0", "--allow-requant", "--split-max-size", "0.4M")
    many_parts = sorted((tmp_path / "many").iterdir())
    assert len(many_parts) > 1 and all("-of-" in p.name for p in many_parts)
    assert np.array_equal(llama_logits(many_parts[0], PROMPT), llama_logits(one, PROMPT))


# -- bad input ------------------------------------------------------------------------------------------
def _fails(*args) -> str:
    proc = run_cli(*args, check_rc=2)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return err[0]


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all")
    line = _fails("gguf->hf", bad, tmp_path / "out")
    assert str(bad) in line and "not a GGUF" in line
    assert not (tmp_path / "out").exists()


def test_truncated_gguf(made, tmp_path):
    src = made["llama"]["q4_0"]
    cut = tmp_path / "cut.gguf"
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    line = _fails("gguf->hf", cut, tmp_path / "out")
    assert str(cut) in line and "truncated" in line and "tensor " in line
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:300])  # cut inside the metadata
    line = _fails("gguf->gguf", header, tmp_path / "out.gguf")
    assert str(header) in line
    assert not list(tmp_path.glob("out*"))


def test_missing_split_part(made, tmp_path):
    convert("gguf", made["llama"]["q4_0"], "gguf", tmp_path / "m.gguf", Options(extra={"split_max_size": 300_000}),
            progress=False)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    for given in ("m-00001-of-00003.gguf", "m-00003-of-00003.gguf"):
        line = _fails("gguf->hf", tmp_path / given, tmp_path / "out")
        assert "m-00002-of-00003.gguf" in line and "missing" in line


def test_unknown_and_undecodable_types(made, tmp_path):
    """A type id gguf-py does not know, and a known type without a dequantizer (Q8_1): BadInput naming
    the file (and the tensor)."""
    for type_id, expect in ((9, "Q8_1"), (200, "unknown ggml type id 200")):
        path = tmp_path / f"t{type_id}.gguf"
        shutil.copy(made["llama"]["f32"], path)
        reader = gguf.GGUFReader(str(path), "r+")
        norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
        norm.field.parts[4][0] = type_id  # the tensor info's ggml type
        reader.data.flush()
        del reader, norm
        line = _fails("gguf->hf", path, tmp_path / f"out{type_id}")
        assert str(path) in line and expect in line and "blk.0.attn_norm.weight" in line, line


def test_reader_api_errors(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        GgufSource(tmp_path / "nope.gguf")
