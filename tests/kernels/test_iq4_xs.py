"""IQ4_XS as a GGUF target, what is its own: the kernel's (kernels/ggml/iq4_xs.py) super-block step as ggml's bytes
show it, its zero super-block, row length and rounding, the checker's verdicts and llama-quantize's 256 -> IQ4_NL
fallback (formats/gguf/schemes.py), and llama-quantize's IQ4_XS file as a source, read and copied. The kernel's
bytes against ggml's own quantize_iq4_xs, its decoder against gguf-py's, and hf -> gguf against llama-quantize,
with every other IQ type: tests/kernels/test_iq_vs_ggml.py.

Oracles, all run here (none stored): ggml_quantize_chunk(GGML_TYPE_IQ4_XS) from llama-cpp-python's
libggml-base.so (kernels/ggml/libggml.py); llama-quantize (llama_cpp.llama_model_quantize,
LLAMA_FTYPE_MOSTLY_IQ4_XS = 30) of our F32 GGUF (tests/kernels/conftest.py); gguf-py's IQ4_XS decoder; llama.cpp
running the file. The data generators and the grid are tests/support/iq_cases.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures
from helpers import gguf_dequant, gguf_tensors, llama_logits, run_cli
from iq_cases import XS_KINDS, _report, _sub_scales, _uniform_grid, _xs_data
from qconvert.converters.checker import EXACT, REFUSED, REQUANTIZE, check, decide
from qconvert.formats.gguf.names import qk_row_permutation
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES, k_fallback
from qconvert.kernels.ggml.libggml import ggml_quantize
from qconvert.kernels.ggml.iq4_xs import dequantize_iq4_xs, nearest_int, quantize_iq4_xs

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

SB = 136  # bytes per 256-element super-block (gguf-py GGML_QUANT_SIZES)
PROMPT = fixtures.prompt_ids()


# ---------------------------------------------------------------------------------------------------------
# the kernel's super-block step and edge cases (its bytes against ggml's: tests/kernels/test_iq_vs_ggml.py)


def test_the_data_reaches_every_branch_of_the_super_block_step():
    """IQ4_XS's cases in test_iq_vs_ggml.py are not all easy: read from ggml's own bytes, they hold 6-bit scales
    clamped at 31, scales that round to 0 next to live ones, the largest scale (l = -32) and all-zero
    super-blocks."""
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
# an IQ4_XS / IQ4_NL GGUF as the source: its blocks are carried and copied into the same type


@pytest.fixture(scope="module")
def llama_xs(iq_llama) -> Path:
    """llama-quantize's IQ4_XS of the tiny llama's F32 GGUF (tests/kernels/conftest.py)."""
    return iq_llama("IQ4_XS")


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
