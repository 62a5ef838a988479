"""UQFF readers on real producers' files: what mistral.rs 0.9.5 writes for small projections is read (and written
back) exactly, and mutated copies of real mistral.rs files are refused in one line. Mutated hqq files:
tests/formats/hqq/test_bad_hqq.py.

1. k/v projections of 32 rows under mistral.rs' HQQ group of 64: hqq and mistral.rs group the *flattened*
   weight (`W.reshape(gs, -1)`), so a group size needs to divide the element count only. The `kv32`
   fixture (tests/support/fixtures_uqff.py: one kv head of 32) is written by mistral.rs itself as hqq4 and hqq8;
   `uqff->hf` must give mistral.rs' own log-probabilities, `uqff->uqff` the same tensors, `uqff->hqq` a
   checkpoint hqq loads with the same weights.
2. Bad input: every mutated fixture exits 2 with one line naming the file and the tensor or key, leaves
   nothing at OUT (tests/support/helpers.py expect_user_error).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fixtures_uqff as FU
from copy_edit import _copy, _edit
from helpers import expect_user_error, run_cli
from hqq_env import hqq_root  # noqa: F401  (the hqq fixtures, built by hqq's own environment)

mistralrs = pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")

EXACT_TOL = 1e-4


@pytest.fixture(scope="session")
def ufx():
    info = FU.ensure_uqff_fixtures()
    assert not info["failed"], f"mistral.rs could not write: {info['failed']}"
    return info


def _convert(src_fmt, src, dst_fmt, out, **kw):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    return convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)


def _raw(path: Path) -> dict:
    """Every tensor of a safetensors file, or of every .uqff shard of a folder, read with safetensors only."""
    out = {}
    for shard in ([path] if path.is_file() else sorted(path.glob("*.uqff"))):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# =========================================================================================================
# 1. mistral.rs' HQQ layers whose group size does not divide the rows


def _hqq_formula(raw: dict, key: str) -> torch.Tensor:
    """UQFF's HQQ layer as mistral.rs 0.9.5 decodes it (mistralrs-quant/src/hqq/), written here independently
    of qconvert: W.reshape(gs, -1) columns are the groups; 4-bit keeps the first half of the gs rows in the
    high nibble; W = (q - zero) * scale."""
    w = raw[f"{key}.weight"]
    bits, gs = int(raw[f"{key}.weight.bits"]), int(raw[f"{key}.weight.group_size"])
    out, n = (int(x) for x in raw[f"{key}.weight.shape"])
    q = w.to(torch.float32) if bits == 8 else torch.cat([(w >> 4) & 15, w & 15], dim=0).to(torch.float32)
    assert q.shape == (gs, out * n // gs)
    return ((q - raw[f"{key}.weight.zeros"]) * raw[f"{key}.weight.scales"]).reshape(out, n)


@pytest.mark.parametrize("isq", FU.KV32_TYPES)
def test_kv32_fixture_has_groups_larger_than_the_rows(ufx, isq):
    raw = _raw(ufx["uqff"][f"kv32-{isq}"])
    k = "model.layers.0.self_attn.k_proj"
    assert [int(x) for x in raw[f"{k}.weight.shape"]] == [32, 256] and int(raw[f"{k}.weight.group_size"]) == 64
    assert raw[f"{k}.weight.scales"].shape == (1, 128)  # 32 * 256 / 64 groups: half a row's worth


@pytest.mark.parametrize("isq", FU.KV32_TYPES)
def test_kv32_reads_as_mistralrs_computes(ufx, tmp_path, isq):
    """Every layer equals that formula (_hqq_formula), and transformers on `uqff->hf` gives mistral.rs' own
    log-probabilities for the same UQFF."""
    from qconvert.formats.uqff.reader import UqffSource

    d = ufx["uqff"][f"kv32-{isq}"]
    raw = _raw(d)
    recs = {r.name: r for r in UqffSource(d).records()}
    keys = [k[: -len(".weight.format")] for k in raw if k.endswith(".weight.format")]
    assert len(keys) == 16
    for key in keys:
        assert torch.equal(recs[f"{key}.weight"].load().dequantize(torch.float32), _hqq_formula(raw, key)), key
    rep = _convert("uqff", d, "hf", tmp_path / "hf", type="f32")
    assert rep.summary()["max_abs_err"] == 0.0
    mistral = json.loads((d / "mistralrs_logprobs.json").read_text())
    assert FU.teacher_forced_gap(tmp_path / "hf", mistral) < EXACT_TOL
    proc = run_cli("inspect", d)
    assert "hqq" in proc.stdout


@pytest.mark.parametrize("isq", FU.KV32_TYPES)
def test_kv32_uqff_to_uqff_keeps_every_tensor(ufx, tmp_path, isq):
    """Read and written back: the same tensor names, dtypes and bytes in the shard and in the residual (the
    group size of 64 is found again from the 32-row layers' scales, not replaced by their 32 rows)."""
    d = ufx["uqff"][f"kv32-{isq}"]
    rep = _convert("uqff", d, "uqff", tmp_path / "out")
    assert rep.summary()["verdicts"]["exact"] == len(rep.results) == 21
    for name in (f"{isq}-0.uqff", "residual.safetensors"):
        a, b = _raw(d / name), _raw(tmp_path / "out" / name)
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_kv32_uqff_to_hqq_loads_in_hqq(ufx, hqq_root, tmp_path):
    """uqff->hqq keeps codes, scales and zeros (axis 0, group 64 over 32 rows); hqq 0.2.8 loads the
    checkpoint and dequantizes it to exactly our reading of mistral.rs' file; and hqq->uqff gives back
    mistral.rs' tensors."""
    import hqq_env
    from qconvert.formats.uqff.reader import UqffSource

    d = ufx["uqff"]["kv32-hqq4"]
    rep = _convert("uqff", d, "hqq", tmp_path / "hqq", type="qmodel")
    assert rep.summary()["verdicts"]["exact"] == len(rep.results) and rep.summary()["max_abs_err"] == 0.0
    state = torch.load(tmp_path / "hqq" / "qmodel.pt", weights_only=True)["model.layers.1.self_attn.v_proj"]
    assert state["group_size"] == 64 and state["axis"] == 0 and tuple(state["shape"]) == (32, 256)
    loaded = hqq_env._verify(tmp_path / "hqq", tmp_path / "loaded.safetensors", "hqq")
    ours = {r.name: r.load().dequantize(torch.float32) for r in UqffSource(d).records() if r.is_grid}
    assert set(ours) - {"model.embed_tokens.weight"} == set(loaded) - {"__logits__"}
    for name in set(loaded) - {"__logits__"}:
        assert torch.equal(loaded[name], ours[name]), name
    back = _convert("hqq", tmp_path / "hqq", "uqff", tmp_path / "back")
    assert back.summary()["verdicts"]["exact"] == len(back.results)
    a, b = _raw(d), _raw(tmp_path / "back")
    layers = [k for k in a if k.endswith((".weight", ".weight.scales", ".weight.zeros", ".weight.group_size",
                                          ".weight.shape")) and not k.startswith("model.embed_tokens.")]
    assert len(layers) == 15 * 5
    for k in layers:  # the embedding went to hqq dequantized (hqq quantizes linears only): back dense
        assert torch.equal(a[k], b[k]), k


def test_dense_kv32_to_hqq4_loads_in_mistralrs(ufx, tmp_path):
    """hf->uqff --type hqq4 quantizes 32-row projections with groups of 64 as mistral.rs' ISQ does (it was
    refused before), and mistral.rs runs the result as our reader reads it."""

    out = tmp_path / "uqff"
    _convert("hf", ufx["kv32"], "uqff", out, type="hqq4", allow_requant=True)
    raw = _raw(out)
    assert int(raw["model.layers.0.self_attn.k_proj.weight.group_size"]) == 64
    mistral = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff="hqq4-0.uqff")
    _convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    assert FU.teacher_forced_gap(tmp_path / "hf", mistral) < EXACT_TOL


# =========================================================================================================
# 2c. UQFF: per-layer scalars


AFQ_LAYER = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("value", [0, 5, 9, 255, 2])
def test_afq_bits_edited(ufx, tmp_path, value):
    src = _copy(ufx["uqff"]["wide-afq4"], tmp_path / "m")
    name = f"{AFQ_LAYER}.weight.bits"
    _edit(src / "afq4-0.uqff", lambda t: t.__setitem__(name, torch.tensor(value, dtype=torch.uint8)))
    expect_user_error("uqff->hf", src, tmp_path, "afq4-0.uqff", name)


@pytest.mark.parametrize("fixture,suffix,value,needle", [
    ("wide-afq4", "weight.group_size", torch.tensor(16, dtype=torch.uint8), "AFQ group size is 16"),
    ("wide-afq4", "weight.bits", torch.tensor([4, 4], dtype=torch.uint8), "integer scalar"),
    ("wide-afq4", "weight.format", torch.tensor(9, dtype=torch.uint8), "UQFF format tag is 9"),
    ("wide-hqq4", "weight.group_size", torch.tensor(0, dtype=torch.uint32), "HQQ group size"),
    ("wide-hqq4", "weight.group_size", torch.tensor(7, dtype=torch.uint32), "HQQ group size 7"),
    ("wide-hqq4", "weight.group_size", torch.tensor(4000000000, dtype=torch.uint32), "HQQ group size"),
    ("wide-hqq4", "weight.bits", torch.tensor(3, dtype=torch.uint8), "HQQ bits"),
    ("wide-hqq4", "weight.axis", torch.tensor(1, dtype=torch.uint8), "HQQ axis"),
    ("wide-hqq4", "weight.round_zeros", torch.tensor(7, dtype=torch.uint8), "round_zeros"),
    ("wide-hqq4", "weight.shape", torch.tensor([0, 256], dtype=torch.uint32), "weight shape"),
    ("wide-hqq4", "weight.scales", torch.zeros(1, 7), "HQQ scales"),
    ("wide-q4k", "weight.dtype", torch.tensor(99, dtype=torch.uint32), "ggml type id is 99"),
    ("wide-fp8", "weight.dequant_w_scale", torch.tensor(float("inf")), "not a finite number"),
    ("wide-fp8", "weight.dequant_w_scale", torch.tensor(1e30), "beyond float16's range"),
    ("wide-f8q8", "weight.num_blocks", torch.tensor(0, dtype=torch.uint32), "F8Q8 block count"),
])
def test_layer_scalars_are_range_checked(ufx, tmp_path, fixture, suffix, value, needle):
    d = ufx["uqff"][fixture]
    src = _copy(d, tmp_path / "m")
    shard = next(src.glob("*-0.uqff"))
    name = f"{AFQ_LAYER}.{suffix}"
    _edit(shard, lambda t: t.__setitem__(name, value))
    expect_user_error("uqff->hf", src, tmp_path, shard.name, name, needle)


# 2d. UQFF: silent corruption (a model with tensors missing)


def test_missing_residual_is_refused(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-hqq4"], tmp_path / "m")
    (src / "residual.safetensors").unlink()
    for pair in ("uqff->hf", "uqff->gguf"):
        expect_user_error(pair, src, tmp_path, "residual.safetensors", "missing",
                          out_name="out.gguf" if pair.endswith("gguf") else "out")


@pytest.mark.parametrize("drop,needle", [("model.norm.weight", "model.norm.weight"),
                                         ("model.layers.1.post_attention_layernorm.weight",
                                          "model.layers.1.post_attention_layernorm.weight")])
def test_residual_without_the_norms(ufx, tmp_path, drop, needle):
    src = _copy(ufx["uqff"]["wide-afq4"], tmp_path / "m")
    _edit(src / "residual.safetensors", lambda t: t.pop(drop))
    expect_user_error("uqff->hf", src, tmp_path, "residual.safetensors", needle, "neither the UQFF shards")


def test_residual_tensor_of_an_integer_dtype(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-mxfp4"], tmp_path / "m")
    name = "model.layers.0.input_layernorm.weight"
    _edit(src / "residual.safetensors", lambda t: t.__setitem__(name, t[name].to(torch.uint8)))
    expect_user_error("uqff->gguf", src, tmp_path, "residual.safetensors", name, "U8 tensor", out_name="out.gguf")


def test_missing_layer_is_refused(ufx, tmp_path):
    """A layer missing from the shards (and not in the residual) would vanish from the model."""
    src = _copy(ufx["uqff"]["wide-q4k"], tmp_path / "m")
    key = "model.layers.1.mlp.down_proj"
    _edit(src / "q4k-0.uqff", lambda t: [t.pop(k) for k in list(t) if k.startswith(key + ".")])
    expect_user_error("uqff->hf", src, tmp_path, f"{key}.weight", "neither the UQFF shards")


def test_empty_uqff_is_refused(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-q4k"], tmp_path / "m")
    _edit(src / "q4k-0.uqff", lambda t: [t.pop(k) for k in list(t) if not k.startswith("uqff.version.")])
    expect_user_error("uqff->hf", src, tmp_path, "q4k-0.uqff", "no UQFF layers")
    save_file({}, str(src / "q4k-0.uqff"))
    expect_user_error("uqff->hf", src, tmp_path, "q4k-0.uqff", "no version tensors")


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size", 128, "hidden_size"),
    ("intermediate_size", 1024, "intermediate_size"),
    ("num_key_value_heads", 4, "num_key_value_heads"),
    ("num_hidden_layers", 1, "num_hidden_layers"),
    ("num_hidden_layers", "2", "num_hidden_layers"),
])
def test_layer_shapes_against_config(ufx, tmp_path, key, value, needle):
    src = _copy(ufx["uqff"]["wide-hqq8"], tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    expect_user_error("uqff->hf", src, tmp_path, needle)


def test_missing_config_is_refused(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-hqq8"], tmp_path / "m")
    (src / "config.json").unlink()
    expect_user_error("uqff->hf", src, tmp_path, "config.json", "missing")


# 2e. UQFF sets as mistral.rs names them


def test_other_files_beside_the_set_are_not_read(ufx, tmp_path):
    """Files that are not `<stem>-<N>.uqff` shards of the set, nor the residual, change nothing."""
    d = ufx["uqff"]["wide-afq4"]
    src = _copy(d, tmp_path / "m")
    shutil.copy(src / "afq4-0.uqff", src / "afq4-0.uqff.bak")
    shutil.copy(src / "afq4-0.uqff", src / ".afq4-0.uqff")
    save_file({"model.norm.weight": torch.zeros(256)}, str(src / "other.safetensors"))
    (src / "notes.uqff").mkdir()
    a = _convert("uqff", d, "hf", tmp_path / "a", type="f32")
    b = _convert("uqff", src, "hf", tmp_path / "b", type="f32")
    assert [r.plan.name for r in a.results] == [r.plan.name for r in b.results]
    x, y = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_shard_gap_and_two_sets_are_refused(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-afq4"], tmp_path / "m")
    shutil.copy(src / "afq4-0.uqff", src / "afq4-2.uqff")
    expect_user_error("uqff->hf", src, tmp_path, "afq4-2.uqff", "afq4-1.uqff")
    expect_user_error("uqff->hf", src / "afq4-0.uqff", tmp_path, "afq4-2.uqff", "contiguous")
    (src / "afq4-2.uqff").rename(src / "q4k-0.uqff")
    expect_user_error("uqff->hf", src, tmp_path, "several UQFF sets", "afq4", "q4k")


def test_shard_listed_in_uqff_report_is_missing(ufx, tmp_path):
    """mistral.rs' uqff_report.json lists each output's shards: one it lists that is not there is refused."""
    src = _copy(ufx["uqff"]["wide-afq4"], tmp_path / "m")
    report = json.loads((src / "uqff_report.json").read_text())
    report["outputs"][0]["shards"].append("afq4-1.uqff")
    (src / "uqff_report.json").write_text(json.dumps(report))
    expect_user_error("uqff->hf", src, tmp_path, "afq4-1.uqff", "uqff_report.json lists it")


# 2f. truncated shards and header claims


def test_header_length_past_the_end(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-hqq4"], tmp_path / "m")
    shard = src / "hqq4-0.uqff"
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data) * 4).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    expect_user_error("uqff->hf", src, tmp_path, "hqq4-0.uqff")


def test_truncated_residual(ufx, tmp_path):
    src = _copy(ufx["uqff"]["wide-hqq4"], tmp_path / "m")
    res = src / "residual.safetensors"
    res.write_bytes(res.read_bytes()[:-100])
    expect_user_error("uqff->hf", src, tmp_path, "residual.safetensors", "cannot read safetensors file")


def test_header_shape_claims_more_than_the_data(ufx, tmp_path):
    """The JSON header says a tensor is huge while its data offsets stay small: refused before any read."""
    src = _copy(ufx["uqff"]["wide-hqq4"], tmp_path / "m")
    shard = src / "hqq4-0.uqff"
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    name = f"{AFQ_LAYER}.weight"
    header[name]["shape"] = [1 << 31, 1 << 31]
    blob = json.dumps(header).encode()
    blob += b" " * ((-len(blob)) % 8)
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])
    expect_user_error("uqff->hf", src, tmp_path, "hqq4-0.uqff", "cannot read safetensors file")
