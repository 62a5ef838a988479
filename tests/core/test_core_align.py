"""The one alignment checker (converters/align.py) over tiny hand-made grids: every format's scheme table,
the edge cases that decide a verdict, and the writers reading Decisions rather than reason text."""

from __future__ import annotations

import pytest
import torch

from qconvert.converters.checker import (EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, best_aligned,
                                         check, register_family)
from qconvert.converters.plan import Options
from qconvert.converters.records import Grid, GridParams, TensorRecord
from qconvert.formats.gguf.schemes import ALIGNED_CANDIDATES, GGUF_SCHEMES
from qconvert.formats.gptq import GPTQ_SCHEMES
from qconvert.formats.hqq import HQQ_KEEP
from qconvert.formats.qqq import qqq_scheme
from qconvert.formats.common.block_schemes import block_layout
from qconvert.formats.uqff.schemes import UQFF_SCHEMES


def grid(bits=4, group=32, rows=8, cols=64, sym=True, g_idx=None, scales=None, seed=0) -> GridParams:
    gen = torch.Generator().manual_seed(seed)
    n_groups = cols // group
    if scales is None:
        scales = (torch.rand((rows, n_groups), generator=gen) * 0.01 + 0.001).to(torch.float16)
    if sym:
        zeros = torch.full((rows, n_groups), 2 ** (bits - 1), dtype=torch.int16)
    else:
        zeros = torch.randint(0, 2 ** bits, (rows, n_groups), generator=gen, dtype=torch.int16)
    return GridParams(bits=bits, group_size=group, scales=scales, zeros=zeros, g_idx=g_idx)


def test_every_declared_scheme_gets_a_decision_for_a_grid_and_a_dense_tensor():
    schemes = [*GGUF_SCHEMES.values(), *UQFF_SCHEMES.values(), *GPTQ_SCHEMES.values(), HQQ_KEEP,
               qqq_scheme(128, 256), qqq_scheme(-1, 256)]
    for s in schemes:
        for source in (grid(cols=256, group=128), "float16"):
            d = check(source, (64, 256), s)
            assert isinstance(d, Decision) and d.verdict in (EXACT, NEAR_EXACT, REQUANTIZE, REFUSED), (s.name, d)
            assert d.scheme == s.name and d.reason, (s.name, d)


@pytest.mark.parametrize("target,sym,verdict", [("Q4_0", True, EXACT), ("Q4_1", True, EXACT),
                                                ("Q4_0", False, REQUANTIZE), ("Q8_0", True, EXACT),
                                                ("Q5_0", True, EXACT)])
def test_legacy_blocks_hold_4_bit_grids_by_their_zero_points(target, sym, verdict):
    d = check(grid(sym=sym), (8, 64), GGUF_SCHEMES[target])
    assert d.verdict == verdict, d
    if verdict == EXACT:
        assert d.keeps_codes
    else:
        assert d.reason == "zero points do not sit where Q4_0 puts its zero (codes would leave its range)"


def test_asymmetric_grid_in_a_block_min_type_is_exact_or_near_exact_never_requantized():
    d = check(grid(sym=False), (8, 64), GGUF_SCHEMES["Q4_1"])
    assert d.verdict in (EXACT, NEAR_EXACT) and d.keeps_codes and d.reason.startswith("codes kept; block min")


def test_rows_that_are_not_whole_blocks_are_refused_for_grids_and_dense_tensors():
    for source in (grid(cols=48, group=16), "float32"):
        d = check(source, (8, 48), GGUF_SCHEMES["Q4_0"])
        assert d.verdict == REFUSED and d.reason == "rows of 48 are not a whole number of Q4_0 blocks of 32"


def test_wider_codes_than_the_block_type_requantize():
    d = check(grid(bits=8), (8, 64), GGUF_SCHEMES["Q4_0"])
    assert (d.verdict, d.reason) == (REQUANTIZE, "8-bit codes do not fit Q4_0's 4 bits")


def test_act_order_aligns_when_every_32_block_lies_in_one_group():
    cols, group = 128, 32
    inside = torch.arange(cols).view(-1, 32).flip(0).reshape(-1) // group  # whole blocks permuted
    assert check(grid(cols=cols, g_idx=inside), (8, cols), GGUF_SCHEMES["Q4_0"]).verdict == EXACT
    scattered = torch.arange(cols) % (cols // group)  # every column in another group
    d = check(grid(cols=cols, g_idx=scattered), (8, cols), GGUF_SCHEMES["Q4_0"])
    assert d.verdict == REQUANTIZE and d.reason.startswith("groups (act-order")


def test_scales_that_fp16_cannot_hold():
    scales = torch.full((8, 2), 1.0 + 2 ** -20, dtype=torch.float32)
    assert check(grid(scales=scales), (8, 64), GGUF_SCHEMES["Q4_0"]).reason == "scales are not representable in fp16"
    assert check(grid(scales=scales), (8, 64), GPTQ_SCHEMES["v2"]).reason == "scales are not representable in fp16"


def test_k_types_count_the_super_blocks_that_keep_their_codes():
    per_channel = grid(group=256, cols=256)
    d = check(per_channel, (8, 256), GGUF_SCHEMES["Q4_K"])
    assert (d.verdict, d.kept_blocks, d.total_blocks) == (EXACT, 8, 8) and d.keeps_codes
    dense = check("bfloat16", (8, 256), GGUF_SCHEMES["Q4_K"])
    assert dense.verdict == REQUANTIZE and dense.kept_blocks is None and not dense.keeps_codes
    # Q6_K keeps no grid codes: its sub-block scales are 8-bit under the super-scale, another grid
    assert check(per_channel, (8, 256), GGUF_SCHEMES["Q6_K"]).verdict == REQUANTIZE


def test_the_sources_own_ggml_type_is_copied():
    d = check(grid(), (8, 64), GGUF_SCHEMES["Q4_1"], native="Q4_1")
    assert d.copied and d.verdict == EXACT and d.reason == "Q4_1 blocks copied byte for byte"
    assert not check(grid(), (8, 64), GGUF_SCHEMES["Q4_0"], native="Q4_1").copied


def test_float_targets():
    assert check("float16", (4, 4), GGUF_SCHEMES["F32"]).reason == "float16 widens to f32 exactly"
    assert check("bfloat16", (4, 4), GGUF_SCHEMES["F16"]).verdict == NEAR_EXACT
    assert check(grid(), (8, 64), GGUF_SCHEMES["F32"]).verdict == EXACT
    # a scheme's runtime note (mistral.rs multiplies Unquant layers in their stored dtype) reaches the reason
    assert check("float32", (4, 4), UQFF_SCHEMES["f16"]).reason.endswith("; load with dtype f16 in mistral.rs")


def test_gptq_conventions():
    asym = grid(sym=False)
    v1, v2 = check(asym, (8, 64), GPTQ_SCHEMES["v1"]), check(asym, (8, 64), GPTQ_SCHEMES["v2"])
    assert v1.verdict == REFUSED and v1.reason.startswith("asymmetric v1 cannot store a zero point of 0")
    assert v2.verdict == EXACT and v2.keeps_codes
    assert check(grid(bits=5), (8, 64), GPTQ_SCHEMES["v2"]).verdict == REQUANTIZE


def test_afq_picks_the_largest_group_that_tiles_the_source_groups():
    d = check(grid(group=128, cols=256), (8, 256), UQFF_SCHEMES["afq4"])
    assert d.verdict == NEAR_EXACT and d.group_size == 128 and d.keeps_codes
    d = check(grid(group=32, cols=256), (8, 256), UQFF_SCHEMES["afq4"])
    assert d.group_size == 32
    d = check(grid(bits=8, group=32, cols=256), (8, 256), UQFF_SCHEMES["afq4"])  # too many bits: requantize
    assert d.verdict == REQUANTIZE and not d.keeps_codes and d.group_size == 64


def test_codebooks_never_hold_integer_grids_and_mxfp4_needs_whole_blocks():
    assert check(grid(), (8, 64), UQFF_SCHEMES["fp8"]).verdict == REQUANTIZE
    assert check(grid(cols=48, group=16), (8, 48), UQFF_SCHEMES["mxfp4"]).reason == \
        "rows of 48 are not whole MXFP4 blocks of 32"


def test_hqq_keeps_its_own_axis_1_grid_and_refuses_min_forms():
    p = GridParams(bits=4, group_size=64, scales=torch.rand(8, 1), zeros=torch.rand(8, 1) * 15)
    assert check(p, (8, 64), HQQ_KEEP).verdict == EXACT
    with_min = GridParams(bits=4, group_size=64, scales=torch.rand(8, 1), zeros=torch.zeros(8, 1),
                          mins=torch.rand(8, 1))
    assert check(with_min, (8, 64), HQQ_KEEP).reason == "min-form grids (W = s*q + m) have no exact hqq zero point"


def test_best_aligned_takes_the_cheapest_exact_then_near_exact_scheme():
    s, d = best_aligned(grid(bits=3), (8, 64), ALIGNED_CANDIDATES)
    assert (s.name, d.verdict) == ("Q4_0", EXACT)  # 3-bit codes shifted into Q4_0's range
    # 4-bit zero points anywhere in 0..15 fit Q5_0's offset of 16 exactly: cheaper in error than Q4_1, whose
    # block min -s*z rounds to fp16 (near-exact) for these scales
    asym = grid(sym=False)
    assert check(asym, (8, 64), GGUF_SCHEMES["Q4_1"]).verdict == NEAR_EXACT
    s, d = best_aligned(asym, (8, 64), ALIGNED_CANDIDATES)
    assert (s.name, d.verdict) == ("Q5_0", EXACT)
    # a grid no block type holds (axis 0): float32, exact, beats the near-exact F16 listed before it
    axis0 = GridParams(bits=4, group_size=8, scales=torch.rand(1, 64), zeros=torch.rand(1, 64), axis=0)
    s, d = best_aligned(axis0, (8, 64), ALIGNED_CANDIDATES)
    assert (s.name, d.verdict) == ("F32", EXACT)
    assert best_aligned(axis0, (8, 64), [GGUF_SCHEMES["Q4_0"]]) is None


def test_families_are_registered_once_and_schemes_must_name_one():
    with pytest.raises(ValueError, match="unknown scheme family"):
        TargetScheme("x", "no-such-family")
    with pytest.raises(ValueError, match="already registered"):
        register_family("ggml", lambda *a: Decision(EXACT, "x"))


def test_the_gguf_writer_reads_kept_blocks_from_the_decision_not_its_text():
    from qconvert.formats.gguf.writer import GgufWriter

    p = grid(group=256, cols=256)
    rec = TensorRecord("model.layers.0.mlp.up_proj.weight", (8, 256), "grid",
                       lambda: Grid(p, torch.zeros(8, 256, dtype=torch.uint8)), params=p)
    writer = GgufWriter(("llama", 1))
    plan = writer.plan_tensor(rec, Options(type="q4_k"), source=type("S", (), {"config": {}, "quant_config": {}})())
    assert plan.verdict == EXACT and plan.action.quant.keep_codes


def test_decide_names_the_aligned_alternative_and_the_fallback():
    from qconvert.converters.checker import decide

    d = decide(grid(bits=8), (8, 64), GGUF_SCHEMES["Q4_0"], ALIGNED_CANDIDATES)
    assert d.verdict == REQUANTIZE and d.alternative == ("Q8_0", EXACT)
    assert decide(grid(), (8, 64), GGUF_SCHEMES["Q4_0"], ALIGNED_CANDIDATES).alternative is None  # it aligns
    assert decide(grid(), (8, 64), GGUF_SCHEMES["Q4_1"], fallback="Q4_1").fallback == "Q4_1"


def test_a_uqff_scheme_is_named_as_mistral_rs_names_it_and_checked_as_its_ggml_blocks():
    s = UQFF_SCHEMES["q4_0"]
    assert (s.name, block_layout(s).name) == ("q4_0", "Q4_0")
    assert check(grid(), (8, 64), s).verdict == EXACT
    assert check(grid(), (8, 64), s, native="Q4_0").copied
