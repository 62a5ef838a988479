"""Bad input: a one-line error naming the file and tensor, exit 2, no traceback, nothing at OUT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import fixtures
from helpers import edit_safetensors, expect_user_error, run_cli


@pytest.fixture
def ckpt(fx, tmp_path):
    """A private copy of a gptqmodel checkpoint to break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(fx["variants"]["v1_b4_g32_sym"]["ckpt"], dst)
    return dst


def _edit_tensors(ckpt, fn):
    edit_safetensors(ckpt / "model.safetensors", fn)


def _edit_config(ckpt, fn):
    for name in ("config.json", "quantize_config.json"):
        path = ckpt / name
        cfg = json.loads(path.read_text())
        fn(cfg.get("quantization_config", cfg) if name == "config.json" else cfg, cfg)
        path.write_text(json.dumps(cfg))


def _expect_error(ckpt, tmp_path, *needles, pair="gptq->gguf"):
    return expect_user_error(pair, ckpt, tmp_path, *needles, out_name="out.gguf")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error(ckpt, tmp_path, "model.safetensors", "cannot read safetensors file")


@pytest.mark.parametrize("part", ["qzeros", "scales"])
def test_missing_partner_tensor(ckpt, tmp_path, part):
    _edit_tensors(ckpt, lambda t: t.pop(f"model.layers.1.mlp.up_proj.{part}"))
    _expect_error(ckpt, tmp_path, "model.safetensors", f"model.layers.1.mlp.up_proj.{part}", f"without {part}")


def test_shape_that_does_not_match_the_config(ckpt, tmp_path):
    def grow(qc, cfg):
        if "intermediate_size" in cfg:
            cfg["intermediate_size"] = 512
    _edit_config(ckpt, grow)
    _expect_error(ckpt, tmp_path, "down_proj.qweight", "config.json says 512")


def test_bits_five_is_refused(ckpt, tmp_path):
    _edit_config(ckpt, lambda qc, cfg: qc.update(bits=5))
    _expect_error(ckpt, tmp_path, "unsupported bits 5", "qweight")


def test_config_says_v2_for_v1_data(ckpt, tmp_path):
    _edit_config(ckpt, lambda qc, cfg: qc.update(checkpoint_format="gptq_v2", format="gptq_v2"))
    _expect_error(ckpt, tmp_path, "qzeros", "v1 convention", "checkpoint_format")


def test_config_says_v1_for_v2_data(fx, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fx["variants"]["v2_b4_g32_sym"]["ckpt"], ckpt)
    _edit_config(ckpt, lambda qc, cfg: qc.update(checkpoint_format="gptq", format="gptq"))
    _expect_error(ckpt, tmp_path, "qzeros", "v2 convention")


def test_output_that_exists_is_not_overwritten(ckpt, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    proc = run_cli("gptq->gguf", ckpt, out, check_rc=2)
    assert "output exists" in proc.stderr and "--force" in proc.stderr
    assert out.read_bytes() == b"keep me"
    run_cli("gptq->gguf", ckpt, out, "--force")
    assert out.read_bytes()[:4] == b"GGUF"


def test_tokenizer_gguf_cannot_hold_is_refused(ckpt, tmp_path):
    fixtures.build_wordlevel_tokenizer(tmp_path / "wl")
    shutil.copy(tmp_path / "wl" / "tokenizer.json", ckpt / "tokenizer.json")
    _expect_error(ckpt, tmp_path, "tokenizer.json", "WordLevel")


def test_failure_while_writing_leaves_no_partial_output(ckpt, tmp_path):
    """A tensor that only fails when its data is read (after the output was opened)."""
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.mlp.up_proj.qweight":
                                            t["model.layers.1.mlp.up_proj.qweight"].to(torch.float32)}))
    _expect_error(ckpt, tmp_path, "model.layers.1.mlp.up_proj.qweight", "int32")


def test_unknown_type_and_format(ckpt, tmp_path):
    proc = run_cli("gptq->gguf", ckpt, tmp_path / "o.gguf", "--type", "q9_9", check_rc=2)
    assert "unknown GGUF type 'q9_9'" in proc.stderr
    proc = run_cli("gptq->nosuch", ckpt, tmp_path / "o", check_rc=2)
    assert "unknown format 'nosuch'" in proc.stderr


# --- the side files an output carries, checked before the output is created -----------------------------

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("pair", ["gptq->hf", "gptq->mlx", "gptq->uqff"])
@pytest.mark.parametrize("name,damage,needle", [
    ("tokenizer.json", _truncate, "not valid JSON"),
    ("tokenizer_config.json", lambda p: p.write_text("null"), "expected a JSON object, found null"),
])
def test_side_file_that_does_not_parse_is_refused(ckpt, tmp_path, pair, name, damage, needle):
    """A runtime parses the tokenizer files when it loads the model: a copy of a broken one is refused."""
    damage(ckpt / name)
    _expect_error(ckpt, tmp_path, str(ckpt / name), needle, pair=pair)


@pytest.mark.parametrize("name,text,needle", [
    ("tokenizer.json", '{"version": "1.0", "added_tokens": []}', "model is missing"),
    ("tokenizer_config.json", '{"chat_template": 3}', "chat_template is 3: expected a string"),
    ("generation_config.json", "[]", "expected a JSON object, found an array"),
])
def test_side_file_whose_content_is_the_wrong_kind_is_refused(ckpt, tmp_path, name, text, needle):
    (ckpt / name).write_text(text)
    _expect_error(ckpt, tmp_path, str(ckpt / name), needle, pair="gptq->hf")


# --- values that are not finite: refused at the source, never reported as an error of NaN ---------------

def _set_value(ckpt, name, index, value):
    def edit(t):
        t[name][index] = value
    _edit_tensors(ckpt, edit)


@pytest.mark.parametrize("pair,flags", [("gptq->gguf", ()), ("gptq->gguf", ("--allow-requant",)),
                                        ("gptq->hf", ()), ("gptq->gptq", ())])
def test_nan_scale_is_refused_at_the_source(ckpt, tmp_path, pair, flags):
    """A NaN scale makes its group's values NaN: the plan once suggested --allow-requant, which then wrote a
    model reported with rmse NaN (gguf), or copied it as exact (hf, gptq)."""
    _set_value(ckpt, "model.layers.1.mlp.up_proj.scales", (0, 3), float("nan"))
    out = tmp_path / "out"
    proc = run_cli(pair, ckpt, out, *flags, check_rc=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in proc.stderr, err
    assert err == (f"qconvert: error: {ckpt / 'model.safetensors'}, tensor model.layers.1.mlp.up_proj.weight: "
                   "scales hold NaN (output row 3, group 0): the source's values are not finite, and no "
                   "conversion can repair them"), err
    assert "--allow-requant" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "qconvert-tmp" in p.name]


def test_inf_in_a_dense_source_tensor_is_refused(ckpt, tmp_path):
    """A dense tensor is not read before it is written: the measurement finds the inf and names the source."""
    _set_value(ckpt, "model.embed_tokens.weight", (7, 2), float("inf"))
    _expect_error(ckpt, tmp_path, str(ckpt / "model.safetensors"), "tensor model.embed_tokens.weight",
                  "the source's values hold inf (output row 7)", pair="gptq->hf")


def test_values_the_target_decodes_to_nan_are_refused(ckpt, tmp_path):
    """A finite fp16 scale of 60000 whose mlx bias (-scale * 8, kept in float16) overflows: the output would
    decode to NaN, and was reported with a finite max error (Python's max drops a NaN). Refused when planning,
    before anything is written (it was refused only while writing)."""
    _set_value(ckpt, "model.layers.1.mlp.up_proj.scales", (0, 3), 60000.0)
    _expect_error(ckpt, tmp_path, f"refused: model.layers.1.mlp.up_proj.weight in {ckpt / 'model.safetensors'}",
                  "cannot be stored as mlx 4-bit: the bias -scale*zero (480000) overflows float16",
                  pair="gptq->mlx")


# --- a refused plan names the input file ----------------------------------------------------------------

def test_plan_refusal_names_the_input_file(ckpt, tmp_path):
    out = tmp_path / "out.gguf"
    err = run_cli("gptq->gguf", ckpt, out, "--type", "q4_k", check_rc=2).stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and not out.exists(), err
    assert err.startswith(f"qconvert: error: refused: 2 tensor(s) in {ckpt / 'model.safetensors'} would need "
                          "lossy requantization to Q4_K (model.layers.0.mlp.down_proj.weight, "), err
