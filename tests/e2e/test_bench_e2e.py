"""scripts/bench_e2e.py (whole conversions against llama.cpp's route) runs, and the speed paths it measures
keep the numbers: the GGUF writer's one dequantization per tensor, shared with the runner's error
measurement, gives the report the same per-tensor errors as dequantizing the source again; the C
dequantization of GPTQ words gives the torch path's float32 values."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

import bench_e2e
from synthetic_gptq import make_synthetic_gptq


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        bench_e2e.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--busy" in out and "--sizes" in out and "--load" in out


def _tiny(path):
    make_synthetic_gptq(path, hidden=256, intermediate=512, layers=2, heads=4, kv_heads=4, shard_mb=1)
    return path


@pytest.mark.parametrize("gguf_type", ["q4_k_m", "q6_k", "q8_0", "f32"])
def test_shared_dequantization_gives_the_same_report(gguf_type, tmp_path, monkeypatch):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    from qconvert.formats.gguf.writer import GgufSession

    src = _tiny(tmp_path / "gptq")
    opts = Options(type=gguf_type, allow_requant=True)
    taken = []
    real = GgufSession.take_reference

    def spy(self):
        ref = real(self)
        taken.append(ref is not None)
        return ref

    monkeypatch.setattr(GgufSession, "take_reference", spy)
    shared = convert("gptq", src, "gguf", tmp_path / "a.gguf", opts, progress=False)
    assert any(taken)  # the writer handed its dequantization over
    monkeypatch.setattr(GgufSession, "take_reference", lambda self: None)
    again = convert("gptq", src, "gguf", tmp_path / "b.gguf", opts, progress=False)
    a = [(r.plan.name, r.max_abs_err, r.rmse) for r in shared.results]
    b = [(r.plan.name, r.max_abs_err, r.rmse) for r in again.results]
    assert a == b
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_c_gptq_dequantization_equals_torch(monkeypatch):
    from qconvert.converters.records import Grid, GridParams, PackedCodes
    from qconvert.kernels import dequantize_grid
    from qconvert.kernels.ggml import kquant_c
    from qconvert.kernels.bitpack import pack_rows
    from qconvert.kernels.dequant import dequantize_grid_torch

    if not kquant_c.available():
        pytest.skip("no C compiler (or QCONVERT_COMPILE=0): the C kernels are not built")
    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        for gs, act, min_form, in_f in ((128, False, False, 384), (32, True, False, 384), (64, False, True, 384),
                                        (96, False, False, 384), (2048, False, False, 2048)):
            out_f = 40
            codes = torch.randint(0, 2 ** bits, (out_f, in_f), generator=g, dtype=torch.uint8)
            ng = -(-in_f // gs)
            scales = (torch.rand(out_f, ng, generator=g) * 0.01).to(torch.float16)
            zeros = torch.randint(0, 2 ** bits, (out_f, ng), generator=g, dtype=torch.int32)
            g_idx = torch.randperm(in_f, generator=g) // gs if act else None
            mins = (torch.randn(out_f, ng, generator=g) * 0.01).to(torch.float16) if min_form else None
            params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=zeros, g_idx=g_idx, mins=mins)
            grid = Grid(params, packed=PackedCodes(pack_rows(codes.T.contiguous(), bits), bits, "gptq-rows"))
            for dtype in (torch.float32, torch.bfloat16):
                want = dequantize_grid_torch(codes, scales, zeros, gs, g_idx, dtype, mins=mins)
                got = dequantize_grid(grid, dtype)
                assert torch.equal(want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (bits, gs)


def test_kept_codes_of_packed_words():
    """The writer unpacks GPTQ words only for the super-blocks that keep their codes."""
    from qconvert.converters.records import Grid, GridParams, PackedCodes
    from qconvert.formats.common.ggml_codec import _kept_codes
    from qconvert.kernels.bitpack import pack_rows

    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    for bits in (2, 4, 8):
        out_f, in_f = 24, 1024
        codes = torch.randint(0, 2 ** bits, (out_f, in_f), generator=g, dtype=torch.uint8)
        params = GridParams(bits=bits, group_size=128, scales=torch.ones(out_f, 8, dtype=torch.float16),
                            zeros=torch.zeros(out_f, 8, dtype=torch.int32))
        grid = Grid(params, packed=PackedCodes(pack_rows(codes.T.contiguous(), bits), bits, "gptq-rows"))
        perm = torch.randperm(out_f, generator=g)
        for item, want in ((grid, codes), (grid.permute_rows(perm), codes[perm])):
            kept = rng.random(out_f * in_f // 256) < 0.3
            np.testing.assert_array_equal(_kept_codes(item, kept), want.numpy().reshape(-1, 256)[kept])


@pytest.mark.slow
def test_smoke_run_against_llama_cpp(tmp_path):
    """A tiny model through both routes: qconvert's Q4_0 is exact, and its hf->Q4_K_M file, and its IQ1_S file with
    the benchmark's synthetic importance matrix, hold the bytes of llama.cpp's converter + llama-quantize."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from llama_cpp_reference import DEFAULT_SRC

    if not (DEFAULT_SRC / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's converter is not extracted (scripts/test_env.d/30-llama-cpp-src.sh)")
    out = tmp_path / "r.json"
    assert bench_e2e.main(["--work", str(tmp_path / "w"), "--hidden", "256", "--intermediate", "512",
                           "--layers", "2", "--heads", "4", "--kv-heads", "4", "--rounds", "1",
                           "--cases", "gptq:q4_0,hf:q4_k_m,hf:iq1_s", "--json", str(out)]) == 0
    res = {r["case"]: r for r in json.loads(out.read_text())["results"]["idle"]}
    assert res["gptq->q4_0"]["err_ours"][1] == 0.0  # the exact repack
    assert res["hf->q4_k_m"]["same"] is True
    assert res["hf->iq1_s"]["same"] is True  # both quantized with the same imatrix file
    for r in res.values():
        assert len(r["ours"]) == 1 and len(r["route"]) == 1 and r["ours"][0]["peak_mb"] > 0


def test_c_q8_0_repack_equals_torch_and_proves_itself():
    """The C path from GPTQ 2/4/8-bit words to Q8_0 (code - zero, the fp16 scale) gives legacy.repack_grid's bytes
    for grids of every width with integer zero points, and its proof (every word, zero point and scale rebuilt from
    the bytes) catches a flipped value or scale bit."""
    from qconvert.kernels.bitpack import pack_rows, unpack_rows
    from qconvert.kernels.ggml import kquant_c
    from qconvert.kernels.ggml.layouts import layout
    from qconvert.kernels.ggml.legacy import repack_grid

    if not kquant_c.available():
        pytest.skip("no C compiler (or QCONVERT_COMPILE=0): the C kernels are not built")
    g = torch.Generator().manual_seed(3)
    for bits, out_f, in_f, group in ((4, 48, 256, 128), (8, 37, 96, 32), (2, 300, 1024, 64), (8, 16, 512, 512)):
        w = torch.randint(-2 ** 31, 2 ** 31 - 1, (in_f * bits // 32, out_f), dtype=torch.int32, generator=g)
        if bits == 8:  # zero points that keep code - zero within int8, as an exact grid's do
            zeros = torch.randint(1, 2 ** bits, (out_f, in_f // group), generator=g)
            z_col = zeros.repeat_interleave(group, 1)
            codes = unpack_rows(w, bits).T.to(torch.int64)  # [out, in]
            w = pack_rows(torch.minimum(torch.maximum(codes, z_col - 128), z_col + 127).T.contiguous(), bits)
        else:
            zeros = torch.randint(0, 2 ** bits, (out_f, in_f // group), generator=g)
        scales = (torch.rand(out_f, in_f // group, generator=g) * 0.01).to(torch.float16)
        block_group = torch.arange(in_f)[::32] // group
        codes = unpack_rows(w, bits).T.contiguous().to(torch.uint8)
        want = repack_grid(layout("Q8_0"), codes, scales, zeros, block_group).numpy()
        got, bad = kquant_c.gptq_to_q8_0(w.numpy(), bits, zeros[:, block_group].numpy(),
                                         scales[:, block_group].numpy(), threads=2)
        assert bad == 0, bits
        np.testing.assert_array_equal(got, want.reshape(got.shape))
    lib = kquant_c._lib()
    words, d = w.numpy().view(np.uint32), scales[:, block_group].numpy().view(np.uint16)
    z = np.ascontiguousarray(zeros[:, block_group].numpy(), dtype=np.int32)
    for byte in (0, 1, 2, 33):  # the two scale bytes, the first and the last value
        bad_copy = got.copy()
        bad_copy[5, 34 * 3 + byte] ^= 0x01
        assert lib.qc_q8_0_check_gptq(bad_copy.ctypes.data, words.ctypes.data, bits, z.ctypes.data, d.ctypes.data,
                                      out_f, in_f, 0, out_f) >= 1


def test_c_q4_0_repack_equals_torch_and_proves_itself():
    """The C twin of the GPTQ -> Q4_0 word repack gives kernels/gptq_q4_0.py's bytes, and its proof (every
    word and scale rebuilt from the bytes) catches a flipped nibble or scale bit."""
    from qconvert.kernels.ggml import kquant_c
    from qconvert.kernels.ggml.gptq_q4_0 import gptq4_to_q4_0

    if not kquant_c.available():
        pytest.skip("no C compiler (or QCONVERT_COMPILE=0): the C kernels are not built")
    g = torch.Generator().manual_seed(2)
    for out_f, in_f in ((48, 256), (37, 96), (300, 1024)):
        w = torch.randint(-2 ** 31, 2 ** 31 - 1, (in_f // 8, out_f), dtype=torch.int32, generator=g)
        d = (torch.rand(out_f, in_f // 32, generator=g) * 0.01).to(torch.float16)
        got, bad = kquant_c.gptq4_to_q4_0(w.numpy(), d.numpy(), threads=2)
        assert bad == 0
        np.testing.assert_array_equal(got, gptq4_to_q4_0(w, d).numpy())
    lib = kquant_c._lib()
    words, scales = w.numpy().view(np.uint32), d.numpy().view(np.uint16)
    for byte in (0, 1, 2, 17):  # a scale byte, a low nibble, a high nibble
        bad_copy = got.copy()
        bad_copy[5, 18 * 3 + byte] ^= 0x10 if byte >= 2 else 0x01
        assert lib.qc_q4_0_check_gptq4(bad_copy.ctypes.data, words.ctypes.data, scales.ctypes.data, out_f, in_f,
                                       0, out_f) == 1
