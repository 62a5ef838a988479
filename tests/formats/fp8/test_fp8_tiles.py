"""MXFP4 -> FP8 in 128x128 tiles under E8M0 (power-of-two) scales, as the `fp8` writer (transformers'
FineGrainedFP8, scale_fmt ue8m0) and the compressed-tensors float output (`--type fp8`: float-quantized, strategy
block) write it (issue 28, item 4).

Oracles: transformers 5.24's own Fp8Quantize (ue8m0) for the quantizer's bytes; both decodings (the MXFP4
producer's values and the FP8 tiles', float32) for the cast's exactness; transformers (FineGrainedFP8, and
compressed-tensors 0.19) loading the outputs with the source's weights. Sources: llm-compressor 0.14's and
ModelOpt 0.47's MXFP4 llamas (tests/producer_fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import expect_user_error, run_cli

from qconvert.converters.checker import EXACT, REQUANTIZE, check
from qconvert.converters.records import GridParams
from qconvert.formats.common.fp8_tiles import FP8_TILE
from qconvert.formats.compressed_tensors.reader import CtSource
from qconvert.formats.fp8.reader import Fp8Source
from qconvert.formats.modelopt.reader import ModelOptSource
from qconvert.kernels.floatq import E2M1_VALUES, e4m3_exact, element_table
from qconvert.kernels.fp8_tiles import MX_EXPONENT_SPAN, decode_fp8_pow2_tiles, quantize_fp8_pow2_tiles

TESTS = Path(__file__).resolve().parents[2]
CT_MXFP4 = TESTS / "producer_fixtures" / "compressed_tensors" / "mxfp4a16"
MO_MXFP4 = TESTS / "producer_fixtures" / "modelopt" / "mxfp4"


def _grids(src) -> dict:
    return {r.name: r for r in src.records() if r.is_grid}


def test_every_e2m1_value_within_14_binades_is_an_e4m3_value():
    """The threshold the checker uses, shown on the value sets: v * 2**d is E4M3 for every E2M1 v and
    -8 <= d <= 6 (d: a block's exponent below its tile's scale), and not for d = -9 or d = 7."""
    v = torch.tensor(E2M1_VALUES)
    for d in range(-8, 7):
        assert bool(e4m3_exact(v * 2.0 ** d).all()), d
    assert not bool(e4m3_exact(v * 2.0 ** -9).all()) and not bool(e4m3_exact(v * 2.0 ** 7).all())
    assert MX_EXPONENT_SPAN == 6 - (-8)


def _mx_params(exponents: torch.Tensor) -> GridParams:
    return GridParams(bits=4, group_size=32, scales=torch.ldexp(torch.ones(exponents.shape), exponents),
                      zeros=torch.zeros(exponents.shape, dtype=torch.int8), codebook=element_table("e2m1"))


def test_checker_decides_from_the_block_exponents_of_each_tile():
    e = torch.zeros((256, 8), dtype=torch.int32)  # [256, 256] in four tiles
    assert check(_mx_params(e), (256, 256), FP8_TILE).verdict == EXACT
    e[130, 5] = -MX_EXPONENT_SPAN  # tile (1, 1) spans 14 binades: still exact
    assert check(_mx_params(e), (256, 256), FP8_TILE).verdict == EXACT
    e[130, 5] = -MX_EXPONENT_SPAN - 1
    d = check(_mx_params(e), (256, 256), FP8_TILE)
    assert d.verdict == REQUANTIZE and "1 of 4 tiles" in d.reason
    e[0, 0], e[130, 5] = 40, 0  # another tile, the other way
    assert check(_mx_params(e), (256, 256), FP8_TILE).verdict == REQUANTIZE
    assert check("float16", (256, 256), FP8_TILE).verdict == REQUANTIZE


def test_quantizer_is_transformers_fp8_quantize_ue8m0_byte_for_byte():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = SimpleNamespace(weight_block_size=[128, 128], scale_fmt="ue8m0")
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=config))
    g = torch.Generator().manual_seed(28)
    w = torch.randn((384, 256), generator=g) * 0.02
    w[:128, :128] = 0  # an all-zero tile
    w[128:256, :128] *= 1e-30  # tiny: the scale clamps at float32's smallest normal
    w[256:, 128:] *= 1e30  # huge
    w[:128, 128:] = torch.ldexp(torch.ones(128, 128), torch.randint(-20, 20, (128, 128), generator=g))  # powers of 2
    for dtype in (torch.float32, torch.bfloat16):
        out = theirs._quantize_one("x.weight", w.to(dtype))
        codes, e8m0 = quantize_fp8_pow2_tiles(w.to(dtype))
        assert torch.equal(codes, out["x.weight"].view(torch.uint8))
        assert torch.equal(e8m0, out["x.weight_scale_inv"].view(torch.uint8))


def _decode_all(out: Path, fmt: str) -> dict:
    """Every quantized weight of our output, decoded from its FP8 codes and tile scales by the kernel here (and
    by the format's reader: both must agree)."""
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    scale = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    decoded = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name[: -len("weight")] + scale]
            e8m0 = (s if s.dtype == torch.float8_e8m0fnu else s.to(torch.float8_e8m0fnu)).view(torch.uint8)
            assert torch.equal(e8m0.view(torch.float8_e8m0fnu).to(torch.float32), s.to(torch.float32)), name
            decoded[name] = decode_fp8_pow2_tiles(t.view(torch.uint8), e8m0)
    reader = Fp8Source(out) if fmt == "fp8" else CtSource(out)
    for name, rec in _grids(reader).items():
        assert torch.equal(rec.load().dequantize(torch.float32), decoded[name]), name
    return decoded


@pytest.mark.parametrize("fmt, src, target", [("ct", CT_MXFP4, "fp8"), ("modelopt", MO_MXFP4, "fp8"),
                                              ("ct", CT_MXFP4, "compressed-tensors")],
                         ids=["llm-compressor-to-fp8", "modelopt-to-fp8", "llm-compressor-to-ct-fp8"])
def test_mxfp4_casts_exactly_into_fp8_tiles_that_transformers_loads(fmt, src, target, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    extra = ("--type", "fp8") if target == "compressed-tensors" else ()
    run_cli(f"{fmt}->{target}", src, out, *extra, "--report", report)
    rows = json.loads(report.read_text())["tensors"]
    fp8 = [r for r in rows if r["target"].endswith(FP8_TILE.name)]
    assert len(fp8) == 7 and all(r["verdict"] == EXACT and r["max_abs_err"] == 0.0 for r in fp8), rows
    assert all(r["verdict"] == EXACT for r in rows)
    source = _grids(CtSource(src) if fmt == "ct" else ModelOptSource(src))
    decoded = _decode_all(out, "fp8" if target == "fp8" else "ct")
    assert sorted(decoded) == sorted(source) and len(source) == 7
    for name, rec in source.items():  # bit for bit, decoding both
        assert torch.equal(decoded[name], rec.load().dequantize(torch.float32)), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if target == "fp8":
        assert qc["scale_fmt"] == "ue8m0" and qc["weight_block_size"] == [128, 128]
        from transformers import AutoModelForCausalLM

        params = dict(AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
        for name, rec in source.items():  # no GPU: transformers dequantizes to the model dtype
            w = params[name].detach()
            assert torch.equal(decoded[name].to(w.dtype), w), name
    else:
        assert qc["format"] == "float-quantized" and len(qc["config_groups"]) == 1
        assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
        from ct_runtime import _ct_model

        params = {n: t.detach() for n, t in _ct_model(out, dtype=None).named_parameters()}
        for name, rec in source.items():
            assert torch.equal(decoded[name].to(params[name].dtype), params[name]), name


def test_a_tile_past_e4m3s_range_is_requantized_with_its_measured_error(tmp_path):
    """One 32-block's exponent moved 20 binades below its tile's: the plan says requantize (and needs
    --allow-requant, refused in one line naming the file and tensor otherwise), the error is measured."""
    src = tmp_path / "wide"
    shutil.copytree(CT_MXFP4, src)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_scale"
    s = tensors[name].clone()
    s[3, 2] = int(s[:128, :4].max()) - 20
    tensors[name] = s
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = expect_user_error("ct->fp8", src, tmp_path, "model.layers.0.mlp.up_proj.weight", "model.safetensors",
                            "--allow-requant")
    assert "14 binades" in err
    out, report = tmp_path / "out", tmp_path / "r.json"
    run_cli("ct->fp8", src, out, "--allow-requant", "--report", report)
    rows = {r["name"]: r for r in json.loads(report.read_text())["tensors"]}
    wide = rows["model.layers.0.mlp.up_proj.weight"]
    assert wide["verdict"] == REQUANTIZE and wide["max_abs_err"] > 0.0
    theirs = _grids(CtSource(src))["model.layers.0.mlp.up_proj.weight"].load().dequantize(torch.float32)
    ours = _decode_all(out, "fp8")["model.layers.0.mlp.up_proj.weight"]
    assert float((ours - theirs).abs().max()) == pytest.approx(wide["max_abs_err"], rel=1e-6)
    assert torch.equal(ours[128:], theirs[128:]) and not torch.equal(ours[:128], theirs[:128])  # its tile only
    assert sum(r["verdict"] == EXACT for r in rows.values() if r["target"] == FP8_TILE.name) == 6
