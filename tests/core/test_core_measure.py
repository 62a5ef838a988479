"""converters/report.py's measure: the error of a converted tensor against its source, never NaN or inf."""

from __future__ import annotations

import pytest
import torch

from qconvert.converters.records import Dense
from qconvert.converters.report import NotFinite, measure


@pytest.mark.parametrize("c_kernel", [True, False], ids=["c", "torch"])
def test_the_c_measurement_equals_torch_s(c_kernel, monkeypatch):
    """The one-pass C measurement (kernels/ggml/kquant_c.c qc_error_stats) and the torch expression it replaces:
    the same max error, bit for bit, and the RMSE to float64 rounding (its double sum runs in another order), on
    bands of every length mod 8, a float16 target and a 1-D tensor; the C kernel is required where it is built."""
    from qconvert.kernels.ggml import kquant_c

    if c_kernel:
        assert kquant_c.available(), "the C kernels did not build (a C compiler is required in CI)"
    else:
        monkeypatch.setattr(kquant_c, "available", lambda: False)
    g = torch.Generator().manual_seed(3)
    for shape in ((37, 1029), (5, 3), (1000,), (2048, 256)):
        src = torch.randn(shape, generator=g) * 0.02
        for decoded in (src + torch.randn(shape, generator=g) * 1e-4, src.to(torch.float16)):
            max_err, rmse = measure(Dense(src), decoded)
            diff = (decoded.to(torch.float32) - src).abs()
            assert max_err == float(diff.max())
            assert rmse == pytest.approx(float(diff.double().pow(2).mean().sqrt()), rel=1e-12), shape


def test_finite_values_measure_as_before():
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert measure(Dense(src), src + 0.5) == (0.5, 0.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_source_value_that_is_not_finite_is_named_as_the_source(bad):
    src = torch.zeros(6, 4)
    src[4, 1] = bad
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), src.clone())  # a copy: nan - nan and inf - inf are both NaN
    e = info.value
    assert (e.in_source, e.what, e.row) == (True, "NaN" if bad != bad else "inf", 4)


def test_converted_values_that_are_not_finite_are_named_as_the_target():
    src = torch.ones(5, 3)
    decoded = src.clone()
    decoded[2, 0] = float("nan")  # Python's max(0.0, nan) is 0.0: this once measured as max error 0
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), decoded)
    assert (info.value.in_source, info.value.what, info.value.row) == (False, "NaN", 2)


def test_a_one_dimensional_tensor_names_no_row():
    src = torch.ones(8)
    src[3] = float("-inf")
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), torch.ones(8))
    assert (info.value.in_source, info.value.what, info.value.row, str(info.value)) == (
        True, "inf", None, "source values hold inf")


def test_a_bit_identical_copy_of_a_dense_tensor_holding_nan_is_refused(fx, tmp_path, monkeypatch):
    """A writer that proves its bytes identical to the source's (BitIdentical) skips the float pass that finds a
    NaN; the runner still checks a dense source's values. gptqmodel's checkpoint with one NaN in its embedding,
    through the hf writer made to claim a bit-identical copy of every dense tensor: refused naming the file, the
    tensor and the row, nothing written (it converted with exit 0 and error 0 before)."""
    import shutil

    from helpers import edit_safetensors
    from qconvert.converters.errors import BadInput
    from qconvert.converters.plan import BitIdentical, Options
    from qconvert.converters.run import convert
    from qconvert.formats.hf.writer import HfSession

    src = tmp_path / "src"
    shutil.copytree(fx["variants"]["v1_b4_g32_sym"]["ckpt"], src)
    edit_safetensors(src / "model.safetensors",
                     lambda t: t["model.embed_tokens.weight"].__setitem__((7, 2), float("nan")))
    plain_add = HfSession.add

    def claims_identity(self, plan, item):
        decoded = plain_add(self, plan, item)
        return BitIdentical("dense tensor copied unchanged") if isinstance(item, Dense) else decoded

    monkeypatch.setattr(HfSession, "add", claims_identity)
    out = tmp_path / "out"
    with pytest.raises(BadInput) as info:
        convert("gptq", src, "hf", out, Options(), progress=False)
    msg = str(info.value)
    assert str(src / "model.safetensors") in msg and "model.embed_tokens.weight" in msg, msg
    assert "the source's values hold NaN (output row 7)" in msg, msg
    assert not out.exists()
