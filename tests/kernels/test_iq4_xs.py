"""IQ4_XS as a GGUF target: the kernel (kernels/iq4_xs.py) against ggml's own quantize_iq4_xs, the
checker's verdicts and llama-quantize's 256 -> IQ4_NL fallback (formats/gguf/schemes.py), and a conversion
judged by llama.cpp.

Oracles, all run here (none stored): ggml_quantize_chunk(GGML_TYPE_IQ4_XS) from llama-cpp-python's
libggml-base.so (kernels/ggml_ctypes.py), with and without an importance matrix; llama-quantize
(llama_cpp.llama_model_quantize, LLAMA_FTYPE_MOSTLY_IQ4_XS = 30) of our F32 GGUF; gguf-py's IQ4_XS
decoder; llama.cpp running the file; transformers for the dense model. The data generators, the
importance vectors and the grid are tests/kernels/test_iq4_nl.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli, transformers_logits, write_legacy_imatrix
from iq_cases import XS_KINDS, WEIGHTINGS, _hf_to_gguf_name, _imatrix, _report, _uniform_grid, _xs_data
from qconvert.converters.checker import EXACT, REFUSED, REQUANTIZE, check, decide
from qconvert.formats.gguf.names import qk_row_permutation
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq4_xs import dequantize_iq4_xs, nearest_int, quantize_iq4_xs

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_quantize import llama_quantize  # noqa: E402  (needs llama_cpp)

FTYPE_IQ4_XS = 30  # llama.cpp LLAMA_FTYPE_MOSTLY_IQ4_XS
SB = 136  # bytes per 256-element super-block (gguf-py GGML_QUANT_SIZES)
PROMPT = fixtures.prompt_ids()


# ---------------------------------------------------------------------------------------------------------
# the kernel, byte for byte with ggml


def _differing_blocks(ours: np.ndarray, theirs: np.ndarray) -> int:
    return int((ours.reshape(-1, SB) != theirs.reshape(-1, SB)).any(axis=1).sum())


def _sub_scales(data: np.ndarray) -> np.ndarray:
    """The 6-bit scales ls (0..63) of every 32-block, read from block_iq4_xs bytes: [super-blocks, 8]."""
    b = data.reshape(-1, SB)
    high = b[:, 2:4].copy().view("<u2").astype(np.int32)
    ib = np.arange(8)
    return ((b[:, 4 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("kind", XS_KINDS)
def test_kernel_bytes_equal_ggml_quantize_chunk(kind, weighting):
    rng = np.random.default_rng([100 + XS_KINDS.index(kind), WEIGHTINGS.index(weighting)])  # fixed per case
    x = _xs_data(kind, rng)
    rows, n = x.shape
    imatrix = _imatrix(weighting, rng, n)
    ours = quantize_iq4_xs(x, imatrix, threads=1)
    theirs = ggml_quantize(x, "IQ4_XS", imatrix)
    assert ours.shape == theirs.shape == (rows, n // 256 * SB)
    differ = _differing_blocks(ours, theirs)
    assert differ == 0, f"{differ} of {ours.size // SB} super-blocks differ"
    # the decode is gguf-py's, bit for bit
    got = dequantize_iq4_xs(theirs, n)
    want = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.IQ4_XS)
    assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


def test_the_data_reaches_every_branch_of_the_super_block_step():
    """The cases above are not all easy: read from ggml's own bytes, they hold 6-bit scales clamped at 31,
    scales that round to 0 next to live ones, the largest scale (l = -32) and all-zero super-blocks."""
    rng = np.random.default_rng([100 + XS_KINDS.index("mirror"), 0])
    ls = _sub_scales(ggml_quantize(_xs_data("mirror", rng), "IQ4_XS"))
    assert (ls == 63).sum() > 10 and (ls == 0).any(axis=1).all()  # l = +32 clamped; l = -32 in every one
    rng = np.random.default_rng([100 + XS_KINDS.index("subscales"), 0])
    data = ggml_quantize(_xs_data("subscales", rng), "IQ4_XS").reshape(-1, SB)
    ls = _sub_scales(data)
    d = data[:, :2].copy().view(np.float16).ravel()
    live = d != 0
    assert ((ls[live] == 32).sum(axis=1) >= 2).sum() > 10  # l = 0 (dead or small blocks) in live ones
    assert (~live).sum() > 0 and (data[~live, :2] == [0x00, 0x80]).all()  # all-dead: d = -0.0
    zeros = ggml_quantize(np.zeros((1, 256), np.float32), "IQ4_XS")
    assert zeros.tobytes() == quantize_iq4_xs(np.zeros((1, 256), np.float32)).tobytes()


def test_zero_super_block_and_row_length():
    data = quantize_iq4_xs(np.zeros((1, 256), np.float32))
    # d = -0/32 = -0.0 (fp16 0x8000), every l = 0 stored as 32 (scales_h 0b10 x 8 = 0xAAAA), every code 8
    assert data.tobytes() == bytes([0x00, 0x80, 0xAA, 0xAA]) + bytes(4) + bytes([0x88]) * 128
    with pytest.raises(ValueError, match="multiple of IQ4_XS's block of 256"):
        quantize_iq4_xs(np.zeros((1, 128), np.float32))


def test_nearest_int_rounds_half_to_even():
    """C's nearest_int (add 1.5 * 2**23, keep the mantissa) is round-half-to-even inside +-2**22."""
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-40, 40, 5000), np.arange(-40, 40.5, 0.5), [0.0, -0.0, 2 ** 22 - 1.5]])
    x = x.astype(np.float32)
    assert np.array_equal(nearest_int(x), np.rint(x).astype(np.int64))


def test_kernel_bands_and_threads_do_not_change_the_bytes():
    x = (np.random.default_rng(4).standard_normal((1100, 512)) * 0.05).astype(np.float32)  # 3 bands of rows
    imatrix = np.random.default_rng(5).random(512).astype(np.float32)
    want = ggml_quantize(x, "IQ4_XS", imatrix, threads=2)
    assert _differing_blocks(quantize_iq4_xs(x, imatrix, threads=1), want) == 0
    assert _differing_blocks(quantize_iq4_xs(x, imatrix, threads=3), want) == 0


def test_decoder_equals_gguf_py_on_arbitrary_blocks():
    """Every bit pattern decodes as gguf-py decodes it: random bytes (any d, sign, inf or NaN included; all
    64 six-bit scales; every code)."""
    data = np.random.default_rng(6).integers(0, 256, (64, 16 * SB), dtype=np.uint8)
    with np.errstate(all="ignore"):  # inf * 0 and the like, in both
        got = dequantize_iq4_xs(data, 16 * 256)
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.IQ4_XS).reshape(got.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert set(np.unique(_sub_scales(data))) == set(range(64))


# ---------------------------------------------------------------------------------------------------------
# the checker and the 256 fallback


def test_every_source_requantizes_into_iq4_xs_and_short_rows_fall_back_to_iq4_nl():
    s = GGUF_SCHEMES["IQ4_XS"]
    assert (s.ggml_type, s.block, s.group, s.block_bytes, s.scale) == (23, 256, 32, SB, "k6")
    dense = check("float16", (8, 256), s)
    assert dense.verdict == REQUANTIZE and "IQ4_XS quantizer" in dense.reason, dense
    # a Q4_0-like grid: Q4_0 keeps its codes exactly, IQ4_XS cannot (the table's steps are not uniform)
    g = _uniform_grid(cols=256)
    assert check(g, (8, 256), GGUF_SCHEMES["Q4_0"]).verdict == EXACT
    d = decide(g, (8, 256), s, ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and not d.keeps_codes and "non-linear 16-value table" in d.reason, d
    assert "IQ4_XS quantizer" in d.reason and d.alternative == ("Q4_0", EXACT), d
    # rows of no whole 256-block: the checker refuses, naming the fallback; the writer asks k_fallback first,
    # which takes IQ4_NL as llama-quantize's tensor_type_fallback does (dense or grid, 2-D or stacked experts)
    refused = check("float16", (8, 128), s)
    assert refused.verdict == REFUSED and "super-blocks of 256" in refused.reason, refused
    assert "falls back to IQ4_NL" in refused.reason, refused
    assert check(_uniform_grid(cols=128), (8, 128), s).verdict == REFUSED
    note = "IQ4_XS needs rows of 256 (these have 128), fallback IQ4_NL: "
    assert k_fallback("IQ4_XS", (8, 128), None) == ("IQ4_NL", note)
    assert k_fallback("IQ4_XS", (4, 8, 128), _uniform_grid(cols=128))[0] == "IQ4_NL"
    assert k_fallback("IQ4_XS", (8, 48), None)[0] == "F16"  # not whole 32-blocks either: F16, as llama.cpp
    assert k_fallback("IQ4_XS", (8, 512), None) == ("IQ4_XS", "")


# ---------------------------------------------------------------------------------------------------------
# conversions, judged by llama.cpp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (hidden 128, ffn 256, 2 layers), its IQ4_XS GGUF and its F32 GGUF. Only ffn_down has rows
    of 256: the other linears and the embedding fall back to IQ4_NL, in llama-quantize as in ours."""
    d = tmp_path_factory.mktemp("iq4_xs")
    src = fixtures.build_tiny_llama(d / "hf", seed=23)
    fixtures.build_tokenizer(src)
    ours, f32, rep = d / "iq4_xs.gguf", d / "f32.gguf", d / "report.json"
    run_cli("hf->gguf", src, ours, "--type", "iq4_xs", "--allow-requant", "--report", rep, "--quiet")
    run_cli("hf->gguf", src, f32, "--type", "f32", "--quiet")
    return {"src": src, "ours": ours, "f32": f32, "report": _report(rep), "dir": d}


def _same_iq4_tensors(ours: Path, theirs: Path) -> dict[str, list[str]]:
    """Every tensor llama-quantize made IQ4_XS or IQ4_NL has that type in ours too, with the same bytes;
    -> their names by type."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    names: dict[str, list[str]] = {"IQ4_XS": [], "IQ4_NL": []}
    for name, t in sorted(b.items()):
        kind = t.tensor_type.name
        if kind in names:
            assert a[name].tensor_type.name == kind, (name, a[name].tensor_type.name, kind)
            assert bytes(a[name].data) == bytes(t.data), name
            names[kind].append(name)
    return names


def _expect_llama_quantize_types(names: dict[str, list[str]]) -> None:
    assert names["IQ4_XS"] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"], names
    # the other 12 decoder linears and the embedding: rows of 128, IQ4_NL in both (llama-quantize makes
    # output.weight Q8_0: its Q6_K wants rows of 256; ours is IQ4_NL, --type's fallback)
    assert len([n for n in names["IQ4_NL"] if n.startswith("blk.")]) == 12 and "token_embd.weight" in names["IQ4_NL"]


@pytest.fixture(scope="module")
def llama_xs(tiny) -> Path:
    """llama-quantize's IQ4_XS of our F32 GGUF."""
    return llama_quantize(tiny["f32"], tiny["dir"] / "llama-iq4_xs.gguf", FTYPE_IQ4_XS)


def test_hf_to_iq4_xs_equals_llama_quantize(tiny, llama_xs):
    _expect_llama_quantize_types(_same_iq4_tensors(tiny["ours"], llama_xs))
    for e in tiny["report"].values():  # the report says which type each tensor got and why
        if e["target"] == "IQ4_XS":
            assert e["verdict"] == REQUANTIZE and e["reason"] == "dense float16 weights quantized with ggml's " \
                                                                 "IQ4_XS quantizer", e
        elif e["target"] == "IQ4_NL":
            assert e["reason"].startswith("IQ4_XS needs rows of 256 (these have 128), fallback IQ4_NL: "), e
    assert sum(e["target"] == "IQ4_XS" for e in tiny["report"].values()) == 2
    assert sum(e["target"] == "IQ4_NL" for e in tiny["report"].values()) == 14


def test_hf_to_iq4_xs_runs_in_llama_cpp_close_to_transformers(tiny):
    tensors = gguf_tensors(tiny["ours"])
    f32 = gguf_tensors(tiny["f32"])
    for e in tiny["report"].values():  # the report's error is gguf-py's decode against the source
        if e["target"] in ("IQ4_XS", "IQ4_NL"):
            name = _hf_to_gguf_name(e["name"])
            err = float(np.abs(gguf_dequant(tensors[name]).reshape(-1) - np.asarray(f32[name].data).reshape(-1)).max())
            assert err == e["max_abs_err"], (name, err, e)
    got = llama_logits(tiny["ours"], PROMPT)
    want = transformers_logits(tiny["src"], PROMPT)
    # ~4.3-4.5 bits per weight on a random model whose logits have std 1.0, range +-3.7:
    # measured max 0.704, rms 0.178, argmax agreement 0.69
    diff = got - want
    rms = float(np.sqrt(np.mean(diff ** 2)))
    assert float(np.abs(diff).max()) < 1.0 and rms < 0.25, (float(np.abs(diff).max()), rms)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.6


def test_iq4_xs_with_imatrix_equals_llama_quantize_with_it(tiny, tmp_path):
    rng = np.random.default_rng(7)
    f32 = gguf_tensors(tiny["f32"])
    values = {n: (rng.random(int(t.shape[0])) * 4).astype(np.float32) for n, t in f32.items()
              if n.startswith("blk.") and not n.endswith("norm.weight")}
    dat = tmp_path / "imatrix.dat"
    write_legacy_imatrix(dat, values)
    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", tiny["src"], ours, "--type", "iq4_xs", "--allow-requant", "--imatrix", dat,
            "--report", rep, "--quiet")
    weighted = [e for e in _report(rep).values() if "weighted by the imatrix" in e["reason"]]
    assert len(weighted) == 14 and sum(e["target"] == "IQ4_XS" for e in weighted) == 2, weighted
    from qconvert.formats.gguf.imatrix import read_imatrix

    theirs = llama_quantize(tiny["f32"], tmp_path / "llama.gguf", FTYPE_IQ4_XS, imatrix=read_imatrix(dat))
    _expect_llama_quantize_types(_same_iq4_tensors(ours, theirs))
    plain = gguf_tensors(tiny["ours"])  # and the weights did change the bytes
    assert bytes(plain["blk.0.ffn_down.weight"].data) != bytes(gguf_tensors(ours)["blk.0.ffn_down.weight"].data)


def test_llama_cpp_quantizer_backend_writes_the_same_bytes(tiny, tmp_path):
    out = tmp_path / "llama-backend.gguf"
    run_cli("hf->gguf", tiny["src"], out, "--type", "iq4_xs", "--allow-requant", "--quantizer", "llama.cpp",
            "--quiet")
    a, b = gguf_tensors(out), gguf_tensors(tiny["ours"])
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(b[name].data), name


# ---------------------------------------------------------------------------------------------------------
# an IQ4_XS / IQ4_NL GGUF as the source: its blocks are carried and copied into the same type


def test_gguf_reader_carries_iq4_blocks(llama_xs):
    from qconvert.formats.gguf.reader import GgufSource

    src = GgufSource(llama_xs)
    raw = gguf_tensors(llama_xs)
    seen = set()
    for rec in src.records():
        if rec.native_type not in ("IQ4_XS", "IQ4_NL"):
            continue
        item = rec.load()
        t = raw[rec.source_name]
        want = gguf_dequant(t).reshape(rec.shape)
        # values as gguf-py decodes them, rows in HF order (q/k un-permuted), and the blocks in that order too
        assert rec.dtype == "float32" and not rec.is_grid and item.packed.layout == f"ggml:{rec.native_type}"
        got = item.dequantize(torch.float32).numpy()
        blocks = item.packed.words.numpy()
        if rec.name.endswith(("q_proj.weight", "k_proj.weight")):
            perm = qk_row_permutation(rec.name, src.config, "llama")
            got, blocks = got[perm.numpy()], blocks[perm.numpy()]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), rec.name
        assert blocks.tobytes() == bytes(t.data), rec.name
        seen.add(rec.native_type)
    assert seen == {"IQ4_XS", "IQ4_NL"}


def test_gguf_to_gguf_copies_iq4_blocks_and_requantizes_across_types(llama_xs, tmp_path):
    # the same types (the default): every tensor exact, the IQ4 ones "blocks copied", the file's bytes unchanged
    same, rep = tmp_path / "same.gguf", tmp_path / "same.json"
    run_cli("gguf->gguf", llama_xs, same, "--report", rep, "--quiet")
    report = _report(rep)
    assert {e["verdict"] for e in report.values()} == {EXACT}
    copied = [e for e in report.values() if e["reason"] == f"{e['target']} blocks copied byte for byte"]
    assert sorted(e["target"] for e in copied).count("IQ4_XS") == 2 and len(copied) == 16, report  # + Q8_0 output
    a, b = gguf_tensors(llama_xs), gguf_tensors(same)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(b[name].data), name
    assert np.array_equal(llama_logits(llama_xs, PROMPT), llama_logits(same, PROMPT))
    # asked for IQ4_XS: the IQ4_NL tensors (rows of 128) fall back to IQ4_NL and are copied, the IQ4_XS ones too
    out, rep = tmp_path / "xs.gguf", tmp_path / "xs.json"
    run_cli("gguf->gguf", llama_xs, out, "--type", "iq4_xs", "--allow-requant", "--report", rep, "--quiet")
    report = _report(rep)
    iq4 = [e for e in report.values() if e["out_name"] != "output.weight" and e["target"].startswith("IQ4")]
    assert len(iq4) == 15 and all(e["verdict"] == EXACT and e["max_abs_err"] == 0 for e in iq4), iq4
    assert all("fallback IQ4_NL: IQ4_NL blocks copied" in e["reason"] for e in iq4 if e["target"] == "IQ4_NL")
    b = gguf_tensors(out)
    for e in iq4:
        assert bytes(b[e["out_name"]].data) == bytes(a[e["out_name"]].data), e["out_name"]
    # IQ4_XS -> IQ4_NL: requantized from gguf-py's decode with ggml's quantize_iq4_nl
    out, rep = tmp_path / "nl.gguf", tmp_path / "nl.json"
    run_cli("gguf->gguf", llama_xs, out, "--type", "iq4_nl", "--allow-requant", "--report", rep, "--quiet")
    e = next(e for e in _report(rep).values() if e["out_name"] == "blk.0.ffn_down.weight")
    assert e["target"] == "IQ4_NL" and e["verdict"] == REQUANTIZE and "IQ4_NL quantizer" in e["reason"], e
    x = gguf_dequant(a["blk.0.ffn_down.weight"]).reshape(128, 256)
    assert bytes(gguf_tensors(out)["blk.0.ffn_down.weight"].data) == ggml_quantize(x, "IQ4_NL").tobytes()
