"""UQFF (mistral.rs) read and write, checked against mistral.rs 0.9.5 itself (PyPI wheel, CPU).

The fixtures (tests/support/fixtures_uqff.py) are UQFF directories written by mistral.rs' in-situ quantization, with
mistral.rs' own greedy log-probabilities for a prompt. Checks:
- reading: GGUF-block layers equal gguf-py's dequantization of the same bytes; HQQ and AFQ equal mistral.rs' documented
  formulas computed here independently from the raw tensors; every family, through `uqff->hf`, gives
  transformers log-probabilities equal to mistral.rs' on the quantized model (exact families to float
  noise; GGUF block types within the noise of mistral.rs' Q8 activation quantization);
- `uqff->gguf` copies the blocks byte for byte and llama.cpp runs it; `gguf->uqff` gives back the same UQFF;
- writing: what we write loads in mistral.rs (GPTQ, HQQ, dense sources, every family, shards) and its
  log-probabilities match transformers on the source's dequantized weights;
- version rule and bad inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fixtures_uqff as FU
from helpers import expect_user_error, llama_logits, run_cli

mistralrs = pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")

# mistral.rs dequantizes HQQ/AFQ/FP8/F8Q8/MXFP4/Unquant and runs a float matmul: our decode must match to
# float-summation noise. Its CPU GGUF path quantizes activations to Q8 first (mistralrs-quant's CPU GGUF matmul), so
# GGUF block types are compared teacher-forced with a looser tolerance.
EXACT_TOL = 1e-4
GGUF_TOL = 0.1
GGUF_FIXTURES = ("wide-q4_0", "wide-q4k", "wide-q6k", "narrow-q4k")
ALL_FIXTURES = GGUF_FIXTURES + ("wide-hqq4", "wide-hqq8", "wide-afq4", "wide-afq8", "wide-fp8", "wide-f8q8",
                                "wide-mxfp4")


@pytest.fixture(scope="session")
def ufx():
    info = FU.ensure_uqff_fixtures()
    assert not info["failed"], f"mistral.rs could not write: {info['failed']}"
    return info


@pytest.fixture(scope="session")
def jinja(tmp_path_factory):
    return FU.chat_template_file(tmp_path_factory.mktemp("jinja") / "chat.jinja")


def _convert(src_fmt, src, dst_fmt, out, **kw):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    return convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)


def _stem(d: Path) -> str:
    return next(d.glob("*-0.uqff")).name


_raw = FU.raw_tensors  # every tensor of a UQFF set, read with safetensors only


def _layers(d: Path):
    from qconvert.formats.uqff.reader import UqffSource

    src = UqffSource(d)
    return src, {r.name: r for r in src.records()}


# -- the fixtures themselves ----------------------------------------------------------------------------
def test_mistralrs_writes_every_cpu_family(ufx):
    fams = {}
    for name, d in ufx["uqff"].items():
        raw = _raw(d)
        assert int(raw["uqff.version.major"]) == 1 and int(raw["uqff.version.minor"]) == 2
        fams[name] = {int(v) for k, v in raw.items() if k.endswith(".weight.format")}
    assert fams["wide-q4k"] == {0} and fams["wide-hqq4"] == {2} and fams["wide-fp8"] == {3}
    assert fams["wide-afq4"] == {4} and fams["wide-f8q8"] == {5} and fams["wide-mxfp4"] == {6}


# -- reading ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GGUF_FIXTURES)
def test_gguf_blocks_equal_gguf_py(ufx, name):
    import gguf

    d = ufx["uqff"][name]
    raw = _raw(d)
    _, recs = _layers(d)
    seen = set()
    for key in [k[: -len(".weight.format")] for k in raw if k.endswith(".weight.format")]:
        rec = recs[f"{key}.weight"]
        type_name = gguf.GGMLQuantizationType(int(raw[f"{key}.weight.dtype"])).name
        rows, cols = (int(x) for x in raw[f"{key}.weight.shape"])
        data = raw[f"{key}.weight"].numpy().reshape(rows, -1)
        ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
        grid = rec.load()
        assert grid.packed.layout == f"ggml:{type_name}" and np.array_equal(grid.packed.words.numpy(), data)
        got = grid.dequantize(torch.float32).numpy()
        assert ref.shape == (rows, cols) and np.array_equal(got, ref), (key, type_name)
        seen.add(type_name)
    assert seen  # e.g. {"Q4_K", "Q6_K"} or {"Q4_1", "Q4_K", "Q5_1"}


def _hqq_formula(raw: dict, key: str) -> torch.Tensor:
    """mistral.rs' HQQ layout, independently: W.reshape(gs, -1) columns are groups; 4-bit = two halves (high nibble first)."""
    w = raw[f"{key}.weight"]
    bits = int(raw[f"{key}.weight.bits"])
    out, n = (int(x) for x in raw[f"{key}.weight.shape"])
    if bits == 8:
        q = w.to(torch.float32)
    else:
        q = torch.cat([(w >> 4) & 15, w & 15], dim=0).to(torch.float32)
    g = (q - raw[f"{key}.weight.zeros"]) * raw[f"{key}.weight.scales"]
    return g.reshape(out, n)


def _afq_formula(raw: dict, key: str) -> torch.Tensor:
    """mistral.rs' AFQ layout, independently: each row a little-endian bit stream of u32 words, W = scale*q + bias."""
    words = raw[f"{key}.weight"].numpy().astype(np.uint64)
    bits, gs = int(raw[f"{key}.weight.bits"]), int(raw[f"{key}.weight.group_size"])
    out, nwords = words.shape
    n = nwords * 32 // bits
    codes = np.zeros((out, n), dtype=np.int64)
    for c in range(n):
        pos = c * bits
        w0, sh = divmod(pos, 32)
        v = words[:, w0] >> np.uint64(sh)
        if sh + bits > 32:
            v = v | (words[:, w0 + 1] << np.uint64(32 - sh))
        codes[:, c] = (v & np.uint64((1 << bits) - 1)).astype(np.int64)
    s = raw[f"{key}.weight.scales"].repeat_interleave(gs, dim=1)
    b = raw[f"{key}.weight.biases"].repeat_interleave(gs, dim=1)
    return s * torch.from_numpy(codes).to(torch.float32) + b


@pytest.mark.parametrize("name,formula", [("wide-hqq4", _hqq_formula), ("wide-hqq8", _hqq_formula),
                                          ("wide-afq4", _afq_formula), ("wide-afq8", _afq_formula)])
def test_hqq_and_afq_equal_the_spec_formula(ufx, name, formula):
    d = ufx["uqff"][name]
    raw = _raw(d)
    _, recs = _layers(d)
    bits = set()
    for key in [k[: -len(".weight.format")] for k in raw if k.endswith(".weight.format")]:
        got = recs[f"{key}.weight"].load().dequantize(torch.float32)
        assert torch.equal(got, formula(raw, key)), key
        bits.add(int(raw[f"{key}.weight.bits"]))
    if name == "wide-afq4":
        assert bits == {4, 6}  # mistral.rs promotes the embedding and lm_head to AFQ6: the 6-bit stream too


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_reader_matches_mistralrs_logprobs(ufx, tmp_path, name):
    """uqff->hf (float32) in transformers vs mistral.rs running the same UQFF."""
    d = ufx["uqff"][name]
    rep = _convert("uqff", d, "hf", tmp_path / "hf", type="f32")
    assert rep.summary()["max_abs_err"] == 0.0
    mistral = json.loads((d / "mistralrs_logprobs.json").read_text())
    gap = FU.teacher_forced_gap(tmp_path / "hf", mistral)
    assert gap < (GGUF_TOL if name in GGUF_FIXTURES else EXACT_TOL), gap


# -- UQFF <-> GGUF: byte copies ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["wide-q4k", "narrow-q4k"])
def test_uqff_to_gguf_copies_blocks_and_back(ufx, tmp_path, name):
    import gguf

    from qconvert.formats.gguf.names import qk_row_permutation

    d = ufx["uqff"][name]
    out = tmp_path / "m.gguf"
    rep = _convert("uqff", d, "gguf", out)
    assert rep.summary()["verdicts"]["exact"] == len(rep.results)
    src, recs = _layers(d)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    out_name = {r.plan.name: r.plan.out_name for r in rep.results}
    copied = 0
    for name_, rec in recs.items():
        if rec.native_type is None:
            continue
        words = rec.load().packed.words
        perm = qk_row_permutation(name_, src.config, "llama")  # llama.cpp's rope row order for q/k
        if perm is not None:
            words = words[perm]
        t = tensors[out_name[name_]]
        assert t.tensor_type.name == rec.native_type
        assert np.array_equal(np.asarray(t.data).reshape(words.shape[0], -1), words.numpy()), name_
        copied += 1
    assert copied == 16
    # llama.cpp runs it, and agrees with transformers on our decoding of the same UQFF
    ids = json.loads((d / "mistralrs_logprobs.json").read_text())["ids"]
    llama = torch.log_softmax(torch.from_numpy(llama_logits(out, ids)[-1]), -1)
    _convert("uqff", d, "hf", tmp_path / "hf", type="f32")
    from helpers import transformers_logits

    ours = torch.log_softmax(torch.from_numpy(transformers_logits(tmp_path / "hf", ids)[-1]), -1)
    assert float((llama - ours).abs().max()) < GGUF_TOL
    # and back: GGUF -> UQFF gives the very tensors mistral.rs wrote
    back = tmp_path / "back"
    rep = _convert("gguf", out, "uqff", back)
    assert rep.summary()["verdicts"]["exact"] == len(rep.results)
    a, b = _raw(d), _raw(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- writing: mistral.rs loads what we write ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["wide-q4k", "wide-hqq4", "wide-afq4"])
def test_uqff_copy_loads_in_mistralrs_identically(ufx, tmp_path, name):
    d = ufx["uqff"][name]
    out = tmp_path / "copy"
    rep = _convert("uqff", d, "uqff", out)
    assert rep.summary()["verdicts"]["exact"] == len(rep.results) and rep.summary()["max_abs_err"] == 0.0
    ours = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out))
    theirs = json.loads((d / "mistralrs_logprobs.json").read_text())
    assert ours["ids"] == theirs["ids"] and ours["steps"] == theirs["steps"]


GPTQ_CASES = [  # (variant, --type or None, expected UQFF type of the layers, compared with)
    ("v1_b4_g128_sym", None, "q4_0", GGUF_TOL),
    ("v1_b4_g32_asym_zp0", None, "q5_0", GGUF_TOL),
    ("v1_b4_g128_sym", "afq4", "afq4", EXACT_TOL),
    ("v2_b4_g32_asym_zp0", "afq4", "afq4", EXACT_TOL),
    ("v1_b3_g32_sym", "afq3", "afq3", EXACT_TOL),
    ("v1_b8_g128_sym", "afq8", "afq8", EXACT_TOL),
    # per-channel grids keep their codes in Q4_K super-blocks (the checker's kept-block count, as for GGUF)
    ("v1_b4_gm1_sym", "q4k", "q4k", GGUF_TOL),
]


@pytest.mark.parametrize("variant,type_,expect,tol", GPTQ_CASES)
def test_gptq_to_uqff_loads_in_mistralrs(fx, tmp_path, jinja, variant, type_, expect, tol):
    ckpt = fx["variants"][variant]["ckpt"]
    out = tmp_path / "uqff"
    args = ["gptq->uqff", ckpt, out, "--report", tmp_path / "r.json"] + (["--type", type_] if type_ else [])
    run_cli(*args)
    report = json.loads((tmp_path / "r.json").read_text())
    layers = [t for t in report["tensors"] if t["name"].endswith("_proj.weight")]
    # "q4k (Q4_1)": a row that is not whole 256-blocks takes mistral.rs' fallback type (its grid fits exactly too)
    assert {t["target"].split(" (")[0] for t in layers} == {expect}
    assert all(t["verdict"] == "exact" and t["max_abs_err"] == 0.0 for t in report["tensors"]), report["summary"]
    raw = _raw(out)
    assert int(raw["uqff.version.minor"]) == 0  # no Unquant layer, no embedding layer: UQFF 1.0
    if expect.startswith("afq"):
        # GPTQ's packed words are AFQ's bit stream, transposed: moved, not re-encoded
        qweight = load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.down_proj.qweight"]
        assert torch.equal(raw["model.layers.0.mlp.down_proj.weight"].view(torch.int32), qweight.T)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "rope_theta" in cfg
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out), jinja=jinja)
    _convert("gptq", ckpt, "hf", tmp_path / "src_hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "src_hf", mistral) < tol


def test_act_order_gptq_needs_allow_requant(fx, tmp_path):
    ckpt = fx["variants"]["v1_b4_g32_sym_act"]["ckpt"]
    proc = run_cli("gptq->uqff", ckpt, tmp_path / "o", "--type", "afq4", check_rc=2)
    assert "would need lossy requantization to afq4" in proc.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("type_", ["q4k", "hqq4", "afq4", "fp8", "f8q8", "mxfp4", "f32"])
def test_every_family_written_loads_in_mistralrs(ufx, tmp_path, type_):
    """hf -> uqff --type T (requantized), then mistral.rs on it vs transformers on our reading of it."""
    out = tmp_path / "uqff"
    rep = _convert("hf", ufx["wide"], "uqff", out, type=type_, allow_requant=True,
                   tensor_types=[(r"embed_tokens", "q8_0")] if type_ == "f32" else [])
    raw = _raw(out)
    assert int(raw["uqff.version.minor"]) == 2  # the token embedding is a UQFF layer
    if type_ == "f32":  # inline Unquant layers in the run dtype (mistral.rs does not cast them: an F16
        # layer in an F32 run fails with "dtype mismatch in matmul")
        same = _convert("hf", ufx["wide"], "uqff", tmp_path / "same", type=type_)
        assert same.summary()["verdicts"]["exact"] == 21
    else:
        with pytest.raises(Exception, match="lossy requantization"):
            _convert("hf", ufx["wide"], "uqff", tmp_path / "refused", type=type_)
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out))
    _convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    tol = GGUF_TOL if type_ in ("q4k",) else EXACT_TOL
    assert FU.teacher_forced_gap(tmp_path / "hf", mistral) < tol
    assert rep.summary()["tensors"] == 21


def test_unquant_layers_make_uqff_1_1_and_shards_split(fx, tmp_path, jinja):
    ckpt = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    out = tmp_path / "uqff"
    rep = _convert("gptq", ckpt, "uqff", out, type="afq4", tensor_types=[(r"layers\.1\.mlp", "f32")],
                   extra={"uqff_max_shard_bytes": 40_000})
    shards = sorted((p.name for p in out.glob("*.uqff")), key=lambda n: int(n[len("afq4-"):-len(".uqff")]))
    assert len(shards) > 2 and shards[0] == "afq4-0.uqff"
    raw = _raw(out)
    assert int(raw["uqff.version.minor"]) == 1
    assert int(raw["model.layers.1.mlp.up_proj.weight.format"]) == 1
    from qconvert.formats.uqff.reader import UqffSource

    back = UqffSource(out / shards[-1])  # any shard names its whole contiguous set
    assert [p.name for p in back.shard_paths] == shards and len(back.layers) == 14
    assert _convert("uqff", out, "hf", tmp_path / "hf", type="f32").summary()["max_abs_err"] == 0.0
    assert rep.summary()["max_abs_err"] == 0.0
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff="afq4-0.uqff", jinja=jinja)
    _convert("gptq", ckpt, "hf", tmp_path / "src_hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "src_hf", mistral) < EXACT_TOL


def test_qwen2_biases_travel_with_their_layers(tmp_path):
    """Qwen2's q/k/v biases are `<key>.bias` entries next to their UQFF layers; mistral.rs uses them."""
    base = FU._fixtures_module().build_tiny_llama(tmp_path / "qwen2", seed=5, arch="qwen2")
    FU.mistralrs_ready(Path(base))
    out = tmp_path / "uqff"
    _convert("hf", base, "uqff", out, type="afq8", allow_requant=True)
    raw = _raw(out)
    assert "model.layers.0.self_attn.q_proj.bias" in raw and "model.layers.0.self_attn.q_proj.weight" in raw
    with safe_open(str(out / "residual.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.endswith(".bias")]
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out), arch="Qwen2")
    _convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "hf", mistral) < EXACT_TOL


# -- HQQ -------------------------------------------------------------------------------------------------
HQQ_ROOT = Path(__file__).resolve().parents[2] / "_fixtures" / "hqq"


@pytest.fixture(scope="session")
def hqq_tf():
    """The hqq fixtures (tests/formats/hqq/test_hqq.py builds them in the hqq environment)."""
    import hqq_env

    hqq_env._hqq_run("build", "--root", HQQ_ROOT)
    return lambda name: HQQ_ROOT / name / "tf"


def test_hqq_axis0_to_uqff_hqq_is_exact(hqq_tf, tmp_path, jinja):
    out = tmp_path / "uqff"
    rep = _convert("hqq", hqq_tf("b4_g64_ax0"), "uqff", out)
    layers = [r for r in rep.results if r.plan.name.endswith("_proj.weight")]
    assert {r.plan.target for r in layers} == {"hqq4"} and all(r.plan.verdict == "exact" for r in layers)
    assert rep.summary()["max_abs_err"] == 0.0
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out), jinja=jinja)
    _convert("hqq", hqq_tf("b4_g64_ax0"), "hf", tmp_path / "src_hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "src_hf", mistral) < EXACT_TOL
    # and back to hqq axis 0: the same codes, scales and zeros
    back = _convert("uqff", out, "hqq", tmp_path / "hqq")
    assert back.summary()["max_abs_err"] == 0.0 and back.summary()["verdicts"]["exact"] == len(back.results)
    # which hqq itself loads (transformers 4.57.6 + hqq 0.2.8 in their environment) with the same
    # dequantized weights and logits as the original hqq checkpoint
    import hqq_env
    from safetensors.torch import load_file

    loaded = hqq_env._verify(tmp_path / "hqq", tmp_path / "hqq_loaded.safetensors", "transformers")
    original = load_file(str(HQQ_ROOT / "b4_g64_ax0" / "reference.safetensors"))
    assert loaded.keys() == original.keys()
    for key in original:
        assert torch.equal(loaded[key], original[key]), key


def test_hqq_axis1_to_q4_1_blocks(hqq_tf, tmp_path, jinja):
    """GGUF rules: an axis-1 group of 64 covers whole 32-blocks; d = scale, m = -scale*zero rounds to fp16."""
    src = hqq_tf("b4_g64_ax1")
    out = tmp_path / "uqff"
    rep = _convert("hqq", src, "uqff", out, type="q4_1")
    layers = [r for r in rep.results if r.plan.name.endswith("_proj.weight")]
    assert {r.plan.verdict for r in layers} == {"near-exact"} and max(r.max_abs_err for r in layers) < 1e-3
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out), jinja=jinja)
    _convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "hf", mistral) < GGUF_TOL


def test_hqq_axis1_goes_to_afq_and_is_refused_as_hqq(hqq_tf, tmp_path, jinja):
    src = hqq_tf("b4_g64_ax1")
    proc = run_cli("hqq->uqff", src, tmp_path / "refused", "--type", "hqq4", check_rc=2)
    assert "--type afq4 (near-exact)" in proc.stderr and not (tmp_path / "refused").exists()
    out = tmp_path / "uqff"
    rep = _convert("hqq", src, "uqff", out)
    layers = [r for r in rep.results if r.plan.name.endswith("_proj.weight")]
    assert {r.plan.target for r in layers} == {"afq4"}
    assert all(r.plan.verdict in ("near-exact", "exact") and r.max_abs_err < 1e-6 for r in layers)
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff=_stem(out), jinja=jinja)
    _convert("hqq", src, "hf", tmp_path / "src_hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "src_hf", mistral) < EXACT_TOL


# -- UQFF AFQ -> GPTQ ---------------------------------------------------------------------------------------
def test_uqff_afq_to_gptq_exact_only_on_the_integer_grid(fx, ufx, tmp_path):
    ckpt = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    _convert("gptq", ckpt, "uqff", tmp_path / "afq", type="afq4")
    rep = _convert("uqff", tmp_path / "afq", "gptq", tmp_path / "gptq")
    assert rep.summary()["verdicts"]["exact"] == len(rep.results) and rep.summary()["max_abs_err"] == 0.0
    src, ours = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "gptq" / "model.safetensors"))
    assert torch.equal(src["model.layers.0.mlp.down_proj.qweight"], ours["model.layers.0.mlp.down_proj.qweight"])
    # mistral.rs' own AFQ has float biases (group minima): GPTQ cannot hold them without requantizing
    proc = run_cli("uqff->gptq", ufx["uqff"]["wide-afq4"], tmp_path / "no", check_rc=2)
    assert "GPTQ holds integer zero points" in proc.stderr


# -- version rule and bad inputs --------------------------------------------------------------------------
def _rewrite(src_dir: Path, dst: Path, edit) -> Path:
    shutil.copytree(src_dir, dst)
    shard = next(dst.glob("*-0.uqff"))
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata=meta)
    return dst


def _expect_bad(src: Path, tmp_path: Path, *needles) -> str:
    return expect_user_error("uqff->hf", src, tmp_path, *needles)


def test_no_version_tensors(ufx, tmp_path):
    def drop(t):
        for k in [k for k in t if k.startswith("uqff.version.")]:
            del t[k]
    src = _rewrite(ufx["uqff"]["wide-afq4"], tmp_path / "m", drop)
    _expect_bad(src, tmp_path, "afq4-0.uqff", "no version tensors")


def test_newer_minor_refused_by_us_and_by_mistralrs(ufx, tmp_path):
    src = _rewrite(ufx["uqff"]["wide-afq4"], tmp_path / "m",
                   lambda t: t.__setitem__("uqff.version.minor", torch.tensor(3, dtype=torch.uint32)))
    _expect_bad(src, tmp_path, "afq4-0.uqff", "newer mistral.rs: UQFF 1.3")
    with pytest.raises(RuntimeError, match="newer"):
        FU.mistralrs_logprobs(src, tmp_path / "lp.json", from_uqff="afq4-0.uqff")


def test_missing_format_tensor(ufx, tmp_path):
    src = _rewrite(ufx["uqff"]["wide-hqq4"], tmp_path / "m",
                   lambda t: t.pop("model.layers.1.self_attn.k_proj.weight.format"))
    _expect_bad(src, tmp_path, "hqq4-0.uqff", "model.layers.1.self_attn.k_proj.weight.format")


def test_truncated_shard(ufx, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(ufx["uqff"]["wide-q4k"], dst)
    shard = dst / "q4k-0.uqff"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    _expect_bad(dst, tmp_path, "q4k-0.uqff", "cannot read safetensors file")


def test_pre_1_0_numeric_names(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"0": torch.zeros(8, dtype=torch.uint8), "1": torch.zeros(8, dtype=torch.uint8)}, str(d / "old-0.uqff"))
    _expect_bad(d, tmp_path, "old-0.uqff", "pre-1.0 UQFF")


def test_inspect_and_sniff(ufx):
    proc = run_cli("inspect", ufx["uqff"]["wide-q4k"])
    assert "uqff" in proc.stdout and "Q4_K" in proc.stdout
