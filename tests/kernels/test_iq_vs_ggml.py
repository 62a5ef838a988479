"""The IQ kernels against llama.cpp's own quantizers, one comparison over every IQ type: IQ4_NL
(kernels/ggml/iq4_nl.py), IQ4_XS (kernels/ggml/iq4_xs.py), IQ3_S and IQ3_XXS (kernels/ggml/iq3_s.py), IQ2_S, IQ2_XS
and IQ2_XXS (kernels/ggml/iq2.py), on kernels/ggml/iq_lattice.py:

- each kernel's bytes equal ggml's for every data kind of its type and every importance vector (none, random,
  ones, sparse), and the bands and threads it quantizes in do not change them;
- each decoder equals gguf-py's, bit for bit, on ggml's bytes and on arbitrary blocks;
- the hf -> gguf conversions of a tiny llama into IQ4_NL, IQ4_XS and IQ3_S equal what llama-quantize makes of our
  F32 GGUF of it (with an importance matrix too, and through --quantizer llama.cpp), and llama.cpp runs them close
  to transformers.

What is one type's own stays with it: the checker's verdicts, the lattices, the zero, tiny and overflowing inputs,
IQ4_NL from bitsandbytes and auto-round (tests/kernels/test_iq4_nl.py), IQ4 and IQ3_S GGUF files as sources
(test_iq4_xs.py, test_iq3_s.py), the low-bit types' imatrix rule and their conversions, each with an imatrix
(test_iq_low_bit.py). The data kinds and importance vectors are tests/support/iq_cases.py's.

Oracles, all run here (none stored): ggml_quantize_chunk from llama-cpp-python's libggml-base.so
(kernels/ggml/libggml.py), with and without an importance matrix (IQ2_XS and IQ2_XXS: ggml asserts one, and the
kernel refuses to go without); llama-quantize (llama_cpp.llama_model_quantize, LLAMA_FTYPE_MOSTLY_IQ4_NL = 25,
_IQ4_XS = 30, _IQ3_S = 26) of our F32 GGUF; gguf-py's decoders; llama.cpp running the files; transformers for the
dense model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli, transformers_logits, write_legacy_imatrix
from iq_cases import (CONVERTED, FTYPE, IQ3_KINDS, KINDS, WEIGHTINGS, XS_KINDS, _data, _hf_to_gguf_name, _imatrix,
                      _iq3_data, _report, _sub_scales, _xs_data)
from qconvert.converters.checker import REQUANTIZE
from qconvert.kernels.ggml import iq2, iq3_s
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq3_s import dequantize_iq3_s, quantize_iq3_s
from qconvert.kernels.ggml.iq4_nl import dequantize_iq4_nl, quantize_iq4_nl
from qconvert.kernels.ggml.iq4_xs import dequantize_iq4_xs, quantize_iq4_xs

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_quantize import llama_quantize  # noqa: E402  (needs llama_cpp)

LOW_BIT = ("IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_XXS")  # the types llama-quantize wants an importance matrix for
TYPES = ("IQ4_NL", "IQ4_XS", "IQ3_S", *LOW_BIT)
NEEDS_WEIGHTS = ("IQ2_XS", "IQ2_XXS")  # ggml's quantizer asserts an importance matrix
BYTES = {**iq2.IQ2_BYTES, "IQ3_XXS": iq3_s.IQ3_XXS_BYTES}  # the low-bit types' bytes per super-block
# each type's data kinds and their generator: IQ4_NL's; IQ4_XS's (IQ4_NL's, rows made whole super-blocks, and three
# aimed at the super-block step); IQ3_S's for IQ3_S and the low-bit types (IQ4_XS's less "huge", where ggml's IQ3_S
# aborts, tests/kernels/test_iq3_s.py, and three more)
DATA = {"IQ4_NL": (KINDS, _data), "IQ4_XS": (XS_KINDS, _xs_data), "IQ3_S": (IQ3_KINDS, _iq3_data),
        **{t: (IQ3_KINDS, _iq3_data) for t in LOW_BIT}}
CASES = [(t, kind, weighting) for t in TYPES for kind in DATA[t][0] for weighting in WEIGHTINGS]
PROMPT = fixtures.prompt_ids()


def _seed(t: str, kind: str, weighting: str) -> list[int]:
    """The generator's seed of one case: IQ4_NL's kinds count from 0, IQ4_XS's from 100, IQ3_S's from 300; a
    low-bit type's seed starts with 500 + its place in LOW_BIT."""
    k, w = DATA[t][0].index(kind), WEIGHTINGS.index(weighting)
    if t in LOW_BIT:
        return [500 + LOW_BIT.index(t), k, w]
    return [{"IQ4_NL": 0, "IQ4_XS": 100, "IQ3_S": 300}[t] + k, w]


def _kernel(t: str):
    """(quantize, dequantize, elements per block, bytes per block) of an IQ type: IQ4_NL's blocks of 32, the others'
    super-blocks of 256 (bytes as gguf-py's GGML_QUANT_SIZES has them)."""
    if t == "IQ4_NL":
        return quantize_iq4_nl, dequantize_iq4_nl, 32, 18
    if t == "IQ4_XS":
        return quantize_iq4_xs, dequantize_iq4_xs, 256, 136
    if t == "IQ3_S":
        return quantize_iq3_s, dequantize_iq3_s, 256, 110
    module = iq3_s if t.startswith("IQ3") else iq2
    return getattr(module, f"quantize_{t.lower()}"), getattr(module, f"dequantize_{t.lower()}"), 256, BYTES[t]


def _differing_blocks(ours: np.ndarray, theirs: np.ndarray, sb: int) -> int:
    return int((ours.reshape(-1, sb) != theirs.reshape(-1, sb)).any(axis=1).sum())


# ---------------------------------------------------------------------------------------------------------
# the kernels, byte for byte with ggml


@pytest.mark.parametrize("t, kind, weighting", CASES)
def test_kernel_bytes_equal_ggml_quantize_chunk(t, kind, weighting):
    quantize, dequantize, block, sb = _kernel(t)
    rng = np.random.default_rng(_seed(t, kind, weighting))  # fixed per case
    x = DATA[t][1](kind, rng)
    rows, n = x.shape
    imatrix = _imatrix(weighting, rng, n)
    if imatrix is None and t in NEEDS_WEIGHTS:  # ggml aborts (test_iq_low_bit.py test_iq2_xs_without_weights_...)
        with pytest.raises(ValueError, match="needs an importance matrix"):
            quantize(x, None)
        return
    ours = quantize(x, imatrix, threads=1)
    theirs = ggml_quantize(x, t, imatrix)
    assert ours.shape == theirs.shape == (rows, n // block * sb)
    differ = _differing_blocks(ours, theirs, sb)
    assert differ == 0, f"{differ} of {ours.size // sb} {'blocks' if block == 32 else 'super-blocks'} differ"
    # the decode is gguf-py's, bit for bit
    got = dequantize(theirs, n)
    want = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType[t])
    assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


# rows enough for more than one band: 1200 (IQ4_NL), 3 bands (IQ4_XS, IQ3_S), 2 bands (the low-bit types)
BAND_ROWS = {"IQ4_NL": 1200, "IQ4_XS": 1100, "IQ3_S": 1100, **{t: 600 for t in LOW_BIT}}


@pytest.mark.parametrize("t", TYPES)
def test_kernel_bands_and_threads_do_not_change_the_bytes(t):
    quantize, _, _, sb = _kernel(t)
    x = (np.random.default_rng(4).standard_normal((BAND_ROWS[t], 512)) * 0.05).astype(np.float32)
    imatrix = np.random.default_rng(5).random(512).astype(np.float32)
    want = ggml_quantize(x, t, imatrix, threads=2)
    for threads in (1, 3):
        ours = quantize(x, imatrix, threads=threads)
        assert _differing_blocks(ours, want, sb) == 0, threads
        assert np.array_equal(ours, want), threads


@pytest.mark.parametrize("t", [t for t in TYPES if t != "IQ4_NL"])
def test_decoder_equals_gguf_py_on_arbitrary_blocks(t):
    """Every bit pattern decodes as gguf-py decodes it: random bytes (any d, sign, inf or NaN included; every grid
    index and scale: IQ4_XS's 64 six-bit scales and IQ3_S's 512 grid indices are counted)."""
    _, dequantize, _, sb = _kernel(t)
    data = np.random.default_rng(6).integers(0, 256, (64, 16 * sb), dtype=np.uint8)
    with np.errstate(all="ignore"):  # inf * 0 and the like, in both
        got = dequantize(data, 16 * 256)
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t]).reshape(got.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    if t == "IQ4_XS":
        assert set(np.unique(_sub_scales(data))) == set(range(64))
    if t == "IQ3_S":
        b = data.reshape(-1, sb)
        high = np.unpackbits(b[:, 66:74], axis=1, bitorder="little").astype(np.int32) << 8
        index = b[:, 2:66].astype(np.int32) | high
        assert np.unique(index).size == 512


# ---------------------------------------------------------------------------------------------------------
# conversions, judged by llama-quantize and llama.cpp (the tiny llama of each type: tests/kernels/conftest.py;
# the low-bit types', each with an imatrix: tests/kernels/test_iq_low_bit.py)


def _same_tensors(ours: Path, theirs: Path, t: str) -> dict[str, list[str]]:
    """Every tensor llama-quantize made of type t or IQ4_NL has that type in ours too, with the same bytes; -> their
    names by type."""
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    names: dict[str, list[str]] = {t: [], "IQ4_NL": []}
    for name, tensor in sorted(b.items()):
        kind = tensor.tensor_type.name
        if kind in names:
            assert a[name].tensor_type.name == kind, (name, a[name].tensor_type.name, kind)
            assert bytes(a[name].data) == bytes(tensor.data), name
            names[kind].append(name)
    return names


def _expect_llama_quantize_types(t: str, names: dict[str, list[str]]) -> None:
    if t == "IQ4_NL":
        # every decoder-layer weight and the embedding (llama-quantize makes output.weight Q8_0 here: its Q6_K
        # wants rows of 256)
        blk = [n for n in names["IQ4_NL"] if n.startswith("blk.")]
        assert len(blk) == 14 and "token_embd.weight" in names["IQ4_NL"], names
        return
    assert names[t] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"], names
    # the other 12 decoder linears and the embedding: rows of 128, IQ4_NL in both (llama-quantize makes
    # output.weight Q8_0: its Q6_K wants rows of 256; ours is IQ4_NL, --type's fallback)
    assert len([n for n in names["IQ4_NL"] if n.startswith("blk.")]) == 12 and "token_embd.weight" in names["IQ4_NL"]


@pytest.mark.parametrize("t", CONVERTED)
def test_hf_to_iq_equals_llama_quantize(t, iq_tiny, iq_llama):
    tiny = iq_tiny(t)
    _expect_llama_quantize_types(t, _same_tensors(tiny["ours"], iq_llama(t), t))
    assert gguf.GGUFReader(str(tiny["ours"])).fields["general.file_type"].contents() == FTYPE[t]
    if t == "IQ4_NL":  # one type throughout: its report is read in the next test
        return
    report = tiny["report"].values()
    for e in report:  # the report says which type each tensor got and why
        if e["target"] == t:
            assert e["verdict"] == REQUANTIZE and e["reason"] == f"dense float16 weights quantized with ggml's " \
                                                                 f"{t} quantizer", e
        elif e["target"] == "IQ4_NL":
            assert e["reason"].startswith(f"{t} needs rows of 256 (these have 128), fallback IQ4_NL: "), e
    assert sum(e["target"] == t for e in report) == 2
    assert sum(e["target"] == "IQ4_NL" for e in report) == 14


@pytest.mark.parametrize("t", CONVERTED)
def test_hf_to_iq_runs_in_llama_cpp_close_to_transformers(t, iq_tiny):
    tiny = iq_tiny(t)
    tensors, f32 = gguf_tensors(tiny["ours"]), gguf_tensors(tiny["f32"])
    if t == "IQ4_NL":
        types = {n: x.tensor_type.name for n, x in tensors.items()}
        linears = [n for n in types if n.startswith("blk.") and not n.endswith("norm.weight")]
        assert len(linears) == 14 and all(types[n] == "IQ4_NL" for n in linears), types
        assert types["token_embd.weight"] == types["output.weight"] == "IQ4_NL"
        assert all(types[n] == "F32" for n in types if n.endswith("norm.weight"))
        for e in tiny["report"].values():
            if e["target"] == "IQ4_NL":
                assert e["verdict"] == REQUANTIZE and "IQ4_NL quantizer" in e["reason"], e
        reported = {_hf_to_gguf_name(e["name"]) for e in tiny["report"].values() if e["target"] == "IQ4_NL"}
        assert set(linears) <= reported, sorted(set(linears) - reported)
    for e in tiny["report"].values():  # the report's error is gguf-py's decode against the source (the F32 file)
        if e["target"] in (t, "IQ4_NL"):
            name = _hf_to_gguf_name(e["name"])
            err = float(np.abs(gguf_dequant(tensors[name]).reshape(-1) - np.asarray(f32[name].data).reshape(-1)).max())
            assert err == e["max_abs_err"], (name, err, e)
    got = llama_logits(tiny["ours"], PROMPT)
    want = transformers_logits(tiny["src"], PROMPT)
    # on a random model whose logits have std 1.0, range +-3.6 to 3.7, measured (max, rms, argmax agreement):
    # IQ4_NL, 4.5 bits per weight (embedding and output too): 0.745, 0.184; IQ4_XS, ~4.3-4.5 bits per weight:
    # 0.704, 0.178, 0.69; IQ3_S, the two ffn_down at 3.44 bits per weight, the rest IQ4_NL fallbacks: 0.733, 0.200,
    # 0.75
    diff = got - want
    rms = float(np.sqrt(np.mean(diff ** 2)))
    assert float(np.abs(diff).max()) < 1.0 and rms < 0.25, (float(np.abs(diff).max()), rms)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.6
    if t != "IQ4_NL":
        return
    # Q4_0 of the same model, the same 4.5 bits: max 0.905, rms 0.206
    q4_0 = tiny["dir"] / "q4_0.gguf"
    run_cli("hf->gguf", tiny["src"], q4_0, "--type", "q4_0", "--allow-requant", "--quiet")
    rms_q4_0 = float(np.sqrt(np.mean((llama_logits(q4_0, PROMPT) - want) ** 2)))
    assert rms < 1.1 * rms_q4_0, (rms, rms_q4_0)  # the non-linear table fits these weights no worse


IMATRIX_SEED = {"IQ4_NL": 5, "IQ4_XS": 7, "IQ3_S": 7}


@pytest.mark.parametrize("t", CONVERTED)
def test_iq_with_imatrix_equals_llama_quantize_with_it(t, iq_tiny, tmp_path):
    tiny = iq_tiny(t)
    rng = np.random.default_rng(IMATRIX_SEED[t])
    f32 = gguf_tensors(tiny["f32"])
    values = {n: (rng.random(int(x.shape[0])) * 4).astype(np.float32) for n, x in f32.items()
              if n.startswith("blk.") and not n.endswith("norm.weight")}
    dat = tmp_path / "imatrix.dat"
    write_legacy_imatrix(dat, values)
    ours, rep = tmp_path / "ours.gguf", tmp_path / "report.json"
    run_cli("hf->gguf", tiny["src"], ours, "--type", t.lower(), "--allow-requant", "--imatrix", dat,
            "--report", rep, "--quiet")
    weighted = [e for e in _report(rep).values() if "weighted by the imatrix" in e["reason"]]
    assert len(weighted) == 14, [e["reason"] for e in _report(rep).values()]
    if t != "IQ4_NL":
        assert sum(e["target"] == t for e in weighted) == 2, weighted
    # llama.cpp gets the values as llama-quantize computes them from the file (value / ncall)
    from qconvert.formats.gguf.imatrix import read_imatrix

    theirs = llama_quantize(tiny["f32"], tmp_path / "llama.gguf", FTYPE[t], imatrix=read_imatrix(dat))
    _expect_llama_quantize_types(t, _same_tensors(ours, theirs, t))  # the embedding has no entry: unweighted in both
    plain = gguf_tensors(tiny["ours"])  # and the weights did change the bytes
    assert bytes(plain["blk.0.ffn_down.weight"].data) != bytes(gguf_tensors(ours)["blk.0.ffn_down.weight"].data)
    # llama.cpp's own quantizer behind --quantizer llama.cpp writes the same file
    other = tmp_path / "llama-backend.gguf"
    run_cli("hf->gguf", tiny["src"], other, "--type", t.lower(), "--allow-requant", "--imatrix", dat,
            "--quantizer", "llama.cpp", "--quiet")
    assert other.read_bytes() == ours.read_bytes()


@pytest.mark.parametrize("t", CONVERTED)
def test_llama_cpp_quantizer_backend_writes_the_same_bytes(t, iq_tiny, tmp_path):
    tiny = iq_tiny(t)
    out = tmp_path / "llama-backend.gguf"
    run_cli("hf->gguf", tiny["src"], out, "--type", t.lower(), "--allow-requant", "--quantizer", "llama.cpp",
            "--quiet")
    a, b = gguf_tensors(out), gguf_tensors(tiny["ours"])
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and bytes(a[name].data) == bytes(b[name].data), name
