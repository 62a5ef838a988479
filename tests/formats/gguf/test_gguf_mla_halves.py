"""llama.cpp's MLA halves through gguf->gguf: the deepseek2 / glm-dsa files store each layer's kv_b_proj as two
tensors, attn_k_b {nope, kv_lora, heads} and attn_v_b {kv_lora, v, heads} (ggml order). The GGUF reader merges them
into the one float32 kv_b_proj every other target wants (archs.merge_kv_b); a GGUF target writes the file's own
halves instead (NativeForm archs.KV_B_HALVES), so that they keep their types and bytes as every other tensor does.

- GGUFs of each kind of half: our gptq->gguf of gptqmodel's DeepSeek-V3 and GLM-5 fixtures (attn_v_b Q4_0 with the
  GPTQ codes, attn_k_b F32), hf->gguf --type f16 of the tiny dense DeepSeek-V3 (both halves F16), and llama-quantize's
  Q4_0 and IQ4_NL of its F32 file (both halves Q4_0 / IQ4_NL: a 3-D block tensor read as the grid, or the codebook
  blocks, of its flattened rows);
- gguf->gguf of each: every tensor of the same ggml type and bytes as the input's, every verdict exact with error 0,
  and llama.cpp computes the very same logits from the output as from the input;
- re-typing other tensors (--tensor-type on the experts) leaves the halves as they are; a half whose block scale is
  NaN is refused in one line as any other grid's (the merged kv_b_proj is dense: the halves are checked themselves);
- ->hf is as before: kv_b_proj is the per-head merge of the halves' gguf-py decodings (and, for the F16 file, the
  source checkpoint's kv_b_proj rounded to fp16).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import fixtures_archs
from gguf_arch_files import ROOT, cached
from helpers import expect_user_error, gguf_tensors, llama_logits, run_cli
from llama_quantize import llama_quantize

gguf = pytest.importorskip("gguf")

PRODUCER_FIXTURES = Path(__file__).parents[2] / "producer_fixtures"
PROMPT = fixtures_archs.arch_prompt()
# the types of (attn_k_b, attn_v_b) in each input: what the test makes sure it covers
HALVES = {"gptq_deepseek_v3": ("F32", "Q4_0"), "gptq_glm_dsa": ("F32", "Q4_0"), "deepseek_v3-f16": ("F16", "F16"),
          "deepseek_v3-llama-q4_0": ("Q4_0", "Q4_0"), "deepseek_v3-llama-iq4_nl": ("IQ4_NL", "IQ4_NL")}
LLAMA_FTYPES = {"deepseek_v3-llama-q4_0": 2, "deepseek_v3-llama-iq4_nl": 25}  # LLAMA_FTYPE_MOSTLY_Q4_0, _IQ4_NL


def _deepseek_v3() -> Path:
    """The tiny dense DeepSeek-V3 of the architecture tests (the same cache as test_gguf_archs.model_dir)."""
    return cached(ROOT / "deepseek_v3", lambda d: fixtures_archs.build_arch_model(d, "deepseek_v3"))


def _source(kind: str) -> Path:
    """The GGUF of that kind (HALVES), made once."""
    if kind.startswith("gptq_"):
        model = PRODUCER_FIXTURES / kind / "model"
        return cached(ROOT / f"{kind}-q4_0.gguf", lambda out: run_cli("gptq->gguf", model, out))
    if kind == "deepseek_v3-f16":
        return cached(ROOT / f"{kind}.gguf", lambda out: run_cli("hf->gguf", _deepseek_v3(), out, "--type", "f16"))
    f32 = cached(ROOT / "deepseek_v3-f32.gguf", lambda out: run_cli("hf->gguf", _deepseek_v3(), out, "--type", "f32"))
    return cached(ROOT / f"{kind}.gguf", lambda out: llama_quantize(f32, out, LLAMA_FTYPES[kind]))


def _halves(tensors: dict) -> dict[str, tuple[str, str]]:
    """{layer: (attn_k_b type, attn_v_b type)} of a file's tensors."""
    found: dict[str, dict[str, str]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("attn_k_b", "attn_v_b"):
            found.setdefault(parts[1], {})[parts[2]] = t.tensor_type.name
    return {block: (pair["attn_k_b"], pair["attn_v_b"]) for block, pair in found.items()}


def _same_tensors(a: dict, b: dict, retyped=()) -> None:
    """The same tensors, each of the same ggml type and bytes, but those named in `retyped`."""
    assert a.keys() == b.keys()
    for name in a:
        if name in retyped:
            continue
        assert a[name].tensor_type == b[name].tensor_type, (name, a[name].tensor_type.name, b[name].tensor_type.name)
        assert np.asarray(a[name].data).tobytes() == np.asarray(b[name].data).tobytes(), name


@pytest.mark.parametrize("kind", list(HALVES))
def test_gguf_to_gguf_keeps_the_mla_halves(kind, tmp_path):
    src = _source(kind)
    a = gguf_tensors(src)
    halves = _halves(a)
    assert halves and set(halves.values()) == {HALVES[kind]}, halves
    out, report = tmp_path / "out.gguf", tmp_path / "report.json"
    run_cli("gguf->gguf", src, out, "--report", report)
    _same_tensors(a, gguf_tensors(out))
    rep = json.loads(report.read_text())
    assert {t["verdict"] for t in rep["tensors"]} == {"exact"} and rep["summary"]["max_abs_err"] == 0.0
    named = {t["out_name"]: t for t in rep["tensors"]}
    for block, types in halves.items():
        for half, ggml_type in zip(("attn_k_b", "attn_v_b"), types):
            t = named[f"blk.{block}.{half}.weight"]
            assert t["target"] == ggml_type, t
            if ggml_type not in ("F32", "F16"):  # a block type: its blocks, not a requantization of their values
                assert t["reason"] == f"{ggml_type} blocks copied byte for byte", t
    # (helpers.llama_logits runs llama.cpp without its extra buffer types on an AMX CPU, which cannot run these halves)
    assert np.array_equal(llama_logits(out, PROMPT), llama_logits(src, PROMPT))


def _merged(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj [heads * (nope + v), kv_lora] from k_b [heads, kv_lora, nope] and v_b [heads, v, kv_lora]: each
    head's key rows (k_b transposed) then its value rows, as transformers' DeepseekV3 splits kv_b_proj's output."""
    per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return per_head.reshape(-1, per_head.shape[-1])


@pytest.mark.parametrize("kind", ["gptq_deepseek_v3", "deepseek_v3-f16"])
def test_to_hf_still_merges_the_halves(kind, tmp_path):
    """->hf is unchanged by the halves travelling beside kv_b_proj: the merge of their gguf-py decodings."""
    from safetensors.torch import load_file

    src = _source(kind)
    a = gguf_tensors(src)
    run_cli("gguf->hf", src, tmp_path / "hf", "--type", "f32")
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    merged = [n for n in back if n.endswith(".self_attn.kv_b_proj.weight")]
    assert len(merged) == len(_halves(a)) >= 2
    for name in merged:
        block = name.split(".")[2]
        k_b, v_b = (a[f"blk.{block}.{half}.weight"] for half in ("attn_k_b", "attn_v_b"))
        want = _merged(*(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                         .reshape([int(d) for d in reversed(list(t.shape))]) for t in (k_b, v_b)))
        assert np.array_equal(back[name].numpy(), want), name
    if kind == "deepseek_v3-f16":  # and that is the checkpoint's own kv_b_proj, rounded to fp16
        original = load_file(str(_deepseek_v3() / "model.safetensors"))
        for name in merged:
            assert torch.equal(back[name], original[name].to(torch.float16).to(torch.float32)), name


def test_retyping_other_tensors_leaves_the_halves(tmp_path):
    """Another type for the experts only (Q4_0 -> Q8_0: their codes kept, exact): the halves stay as stored."""
    src = _source("gptq_deepseek_v3")
    out, report = tmp_path / "out.gguf", tmp_path / "report.json"
    run_cli("gguf->gguf", src, out, "--tensor-type", r"\.mlp\.experts\.=q8_0", "--report", report)
    a, b = gguf_tensors(src), gguf_tensors(out)
    experts = {n for n in a if "_exps." in n}
    assert experts and all(b[n].tensor_type.name == "Q8_0" for n in experts)
    _same_tensors(a, b, retyped=experts)
    rep = json.loads(report.read_text())
    assert {t["verdict"] for t in rep["tensors"]} == {"exact"} and rep["summary"]["max_abs_err"] == 0.0


def test_a_half_with_a_nan_scale_is_refused(tmp_path):
    """attn_v_b's block scales are checked finite as every other grid's: one line naming it, exit 2, nothing written."""
    src = tmp_path / "nan.gguf"
    shutil.copy(_source("gptq_deepseek_v3"), src)
    offset = gguf_tensors(src)["blk.0.attn_v_b.weight"].data_offset + 5 * 18  # the sixth Q4_0 block's fp16 scale
    with open(src, "r+b") as f:
        f.seek(offset)
        f.write(np.float16(np.nan).tobytes())
    expect_user_error("gguf->gguf", src, tmp_path, "nan.gguf", "model.layers.0.self_attn.v_b_proj.weight",
                      "scales hold NaN")
