"""Our GPTQ reader against gptqmodel's own dequantization, bit for bit, on checkpoints gptqmodel made."""

from __future__ import annotations

import pytest
import torch

import fixtures
from qconvert.converters.registry import detect_format
from qconvert.formats.gptq.reader import GptqSource


@pytest.mark.parametrize("variant", sorted(fixtures.VARIANTS))
def test_dequantization_equals_gptqmodel(fx, variant):
    v = fx["variants"][variant]
    weights, _ = fixtures.load_reference(v["reference"])
    source = GptqSource(v["ckpt"])
    grids = [r for r in source.records() if r.is_grid]
    assert len(grids) == len(weights) == 14
    for rec in grids:
        ours = rec.load().dequantize(torch.float32).to(torch.float16)  # gptqmodel computes in fp16
        theirs = torch.from_numpy(weights[rec.name[: -len(".weight")]])
        assert torch.equal(ours, theirs), rec.name
        assert rec.params.bits == v["bits"]


@pytest.mark.parametrize("variant", sorted(fixtures.VARIANTS))
def test_scheme_is_read_from_the_data(fx, variant):
    v = fx["variants"][variant]
    source = GptqSource(v["ckpt"])
    assert detect_format(v["ckpt"]) == ("gptq-v2" if v["fmt"] == "gptq_v2" else "gptq")
    for rec in source.records():
        if not rec.is_grid:
            continue
        p = rec.params
        out_features, in_features = rec.shape
        assert p.group_size == (in_features if v["group_size"] == -1 else v["group_size"])
        assert p.symmetric == v["sym"]
        if v["desc_act"] and p.n_groups > 1:
            assert p.g_idx is not None and not p.contiguous_groups(in_features)
        else:
            assert p.g_idx is None


def test_v1_zero_point_zero_needs_whole_word_decoding(fx):
    """The asym v1 file has zero point 0 in group 0; per-field +1 would decode its neighbour one too low."""
    from qconvert.formats.gptq.layout import decode_zeros
    from qconvert.kernels.bitpack import unpack_rows
    from safetensors.torch import load_file

    v1 = load_file(str(fx["variants"]["v1_b4_g32_asym_zp0"]["ckpt"] / "model.safetensors"))
    v2 = load_file(str(fx["variants"]["v2_b4_g32_asym_zp0"]["ckpt"] / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.qzeros"
    word_add = decode_zeros(v1[name], 4, "v1")
    true_zeros = decode_zeros(v2[name], 4, "v2")
    assert torch.equal(word_add, true_zeros)
    assert int((true_zeros[0] == 0).sum()) > 0  # the borrow case is really present
    per_field = (unpack_rows(v1[name].T.contiguous(), 4).T.to(torch.int16) + 1) % 16
    assert not torch.equal(per_field, true_zeros)


@pytest.mark.parametrize("variant", ("v2_b4_g32_sym", "v1_b4_g32_sym"))
def test_sym_true_with_other_zero_points_is_refused(fx, variant, tmp_path):
    """gptqmodel made the file symmetric (every zero point 8); one field of one group moved to 9 under
    `sym: true`: gptqmodel's torch kernel would apply it and Marlin drop it, so the flag contradicts the data
    and the conversion is refused naming the file and the qzeros tensor (v1 and v2 decoding alike)."""
    import shutil

    from helpers import edit_safetensors, expect_user_error

    src = tmp_path / "src"
    shutil.copytree(fx["variants"][variant]["ckpt"], src)
    name = "model.layers.0.mlp.up_proj.qzeros"

    def bump(t):
        t[name] = t[name].clone()
        t[name][0, 0] += 1  # the first 4-bit field: zero point of output 0, group 0, one higher

    edit_safetensors(src / "model.safetensors", bump)
    err = expect_user_error("gptq->gguf", src, tmp_path, "model.safetensors", name, "says sym true",
                            "1 of", "not the symmetric 8")
    assert "Marlin drops them" in err


def test_mlx_output_whose_float16_bias_overflows_is_refused_at_plan_time(fx, tmp_path):
    """One GPTQ scale raised to 20000 (an fp16 value): mlx would store the bias -s*z = -160000 in float16, inf.
    Refused when planning, in one line naming the input file and the tensor, before any output exists."""
    import shutil

    from helpers import edit_safetensors, expect_user_error

    src = tmp_path / "src"
    shutil.copytree(fx["variants"]["v2_b4_g32_sym"]["ckpt"], src)
    prefix = "model.layers.0.mlp.down_proj"

    def raise_scale(t):
        t[f"{prefix}.scales"] = t[f"{prefix}.scales"].clone()
        t[f"{prefix}.scales"][0, 0] = 20000.0

    edit_safetensors(src / "model.safetensors", raise_scale)
    expect_user_error("gptq->mlx", src, tmp_path, f"refused: {prefix}.weight in ", "src/model.safetensors",
                      "the bias -scale*zero (160000) overflows float16")
    # requantizing cannot help (the grid's values themselves leave float16): refused with --allow-requant too
    from helpers import run_cli

    proc = run_cli("gptq->mlx", src, tmp_path / "out2", "--allow-requant", check_rc=2)
    assert "overflows float16" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out2").exists()
