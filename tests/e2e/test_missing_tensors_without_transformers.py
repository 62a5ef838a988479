"""A checkpoint missing a tensor llama.cpp's loader requires is refused before a GGUF is written, with or without
transformers installed (issue 27: "nothing silently wrong").

transformers is optional: without it class_tensors.py cannot compare the checkpoint with the model class, and
gptqmodel's Qwen3.5 checkpoint with its MTP block's `mtp.fc` removed converted to GGUF with exit 0, the file lacking
blk.4.nextn.eh_proj (llama.cpp's MTP context refuses it). The GGUF writer's own check (formats/gguf/checks.py
_required_block: each arch entry's tables and archs/mtp.py's MtpBlock.required) is what holds without it. "Without
transformers" is simulated with class_tensors._transformers returning None, the one seam through which the checks
reach it, and the CLI is run in this process so that the patch applies; with transformers the same inputs go through
a real CLI process, where the class check or the GGUF check refuses them."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import gguf
import pytest

import fixtures_archs
from gguf_arch_files import ROOT, cached
from helpers import edit_safetensors, expect_user_error
from qconvert.converters import class_tensors
from qconvert.converters.apps.cli import main as cli_main

FIXTURES = Path(__file__).parents[1] / "producer_fixtures"
QWEN35 = FIXTURES / "gptq_qwen35" / "model"  # gptqmodel 7.6's Qwen3.5: 3 linear + 1 full layer, mtp.* block
QWEN35_MOE = FIXTURES / "gptq_qwen35moe" / "model"  # the same with routed and shared experts, mtp.* block too


def glm45_with_mtp() -> Path:
    """The tiny GLM-4.5 with its MTP layer (model.layers.3.*) that tests/formats/gguf/test_gguf_archs_arch_std.py
    builds, from the same cache (whichever test comes first builds it)."""
    return cached(ROOT / "std-glm4_moe-mtp", lambda d: fixtures_archs.build_arch_model(d, "glm4_moe"))


@pytest.fixture
def no_transformers(monkeypatch):
    monkeypatch.setattr(class_tensors, "_transformers", lambda: None)


def _damaged(src: Path, tmp_path: Path, removed: str) -> Path:
    """A copy of the checkpoint without `removed` (a tensor, or a GPTQ module: its qweight, qzeros, scales, g_idx)."""
    folder = tmp_path / "in"
    shutil.copytree(src, folder)

    def drop(tensors):
        gone = [k for k in tensors if k == removed or k.startswith(removed + ".")]
        assert gone, removed
        for k in gone:
            del tensors[k]

    edit_safetensors(folder / "model.safetensors", drop)
    return folder


def _convert_here(src: Path, out: Path) -> tuple[int, str]:
    """`qconvert convert SRC OUT --to gguf` in this process (so that the monkeypatch applies): (exit status,
    stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli_main(["convert", str(src), str(out), "--to", "gguf", "--quiet"])
    return rc, err.getvalue().strip()


# (checkpoint, the tensor or GPTQ module removed, what the refusal names: its HF name and the GGUF tensor)
CASES = [
    (QWEN35, "mtp.fc.weight", "tensor mtp.fc.weight (blk.4.nextn.eh_proj.weight)"),
    (QWEN35, "mtp.pre_fc_norm_hidden.weight", "tensor mtp.pre_fc_norm_hidden.weight (blk.4.nextn.hnorm.weight)"),
    (QWEN35, "mtp.layers.0.self_attn.q_proj.weight",
     "tensor mtp.layers.0.self_attn.q_proj.weight (blk.4.attn_q.weight)"),
    (QWEN35, "model.layers.3.self_attn.k_proj",  # a full-attention trunk layer's GPTQ module
     "tensor model.layers.3.self_attn.k_proj.weight (blk.3.attn_k.weight)"),
    (QWEN35, "model.layers.1.linear_attn.A_log", "tensor model.layers.1.linear_attn.A_log (blk.1.ssm_a)"),
    (QWEN35_MOE, "model.layers.1.mlp.shared_expert_gate.weight",
     "tensor model.layers.1.mlp.shared_expert_gate.weight (blk.1.ffn_gate_inp_shexp.weight)"),
    (QWEN35_MOE, "mtp.layers.0.mlp.shared_expert.up_proj.weight",
     "tensor mtp.layers.0.mlp.shared_expert.up_proj.weight (blk.4.ffn_up_shexp.weight)"),
]
IDS = ["mtp-eh_proj", "mtp-hnorm", "mtp-layer-q", "trunk-full-k", "trunk-linear-A_log", "trunk-shexp-gate",
       "mtp-shexp-up"]


@pytest.mark.parametrize("src, removed, named", CASES, ids=IDS)
def test_missing_tensor_refused_without_transformers(no_transformers, tmp_path, src, removed, named):
    folder = _damaged(src, tmp_path, removed)
    out = tmp_path / "out.gguf"
    rc, err = _convert_here(folder, out)
    assert rc == 2, err
    assert err.startswith(f"qconvert: error: {folder / 'model.safetensors'}, {named}: required tensor is missing"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "qconvert-tmp" in p.name]



@pytest.mark.parametrize("removed, gguf_name", [("model.layers.3.eh_proj.weight", "blk.3.nextn.eh_proj.weight"),
                                                ("model.layers.1.mlp.gate.e_score_correction_bias",
                                                 "blk.1.exp_probs_b.bias")], ids=["mtp-eh_proj", "router-bias"])
def test_glm45_missing_tensor_refused_without_transformers(no_transformers, tmp_path, removed, gguf_name):
    """GLM-4.5 keeps its MTP block as the layer after the trunk (model.layers.3 of 3): the block's own eh_proj and
    a routed layer's score bias, both required by llama.cpp's glm4-moe loader."""
    folder = _damaged(glm45_with_mtp(), tmp_path, removed)
    rc, err = _convert_here(folder, tmp_path / "out.gguf")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{folder / 'model.safetensors'}, tensor {removed} ({gguf_name}): required tensor is missing" in err, err
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("src, removed, named", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_missing_tensor_refused_with_transformers(tmp_path, src, removed, named):
    """With transformers installed (a real CLI process) the same checkpoints are refused too, by whichever check
    sees them first (the class comparison runs before the writer's): one line naming the checkpoint's tensor."""
    folder = _damaged(src, tmp_path, removed)
    expect_user_error("gptq->gguf", folder, tmp_path, str(folder), named.split(" (")[0], out_name="out.gguf")


@pytest.mark.parametrize("src", [QWEN35, QWEN35_MOE], ids=["qwen35", "qwen35moe"])
def test_complete_checkpoints_convert_without_transformers(no_transformers, tmp_path, src):
    """The rules refuse nothing real: the undamaged producer checkpoints convert, their MTP block kept whole."""
    out = tmp_path / "out.gguf"
    rc, err = _convert_here(src, out)
    assert rc == 0, err
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
            "blk.4.nextn.shared_head_norm.weight"} <= names
