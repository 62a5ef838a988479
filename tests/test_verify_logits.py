"""`qconvert verify SRC OUT --logits`: the source and the output run in their own runtimes on the same tokens.

The figures are checked against an independent computation (torch's kl_div over the logits the tests' own
llama.cpp and transformers helpers produce), the ordering of requantization losses is the one a user expects
(Q8_0 < Q4_0 < Q2_K on a model 256 wide, so every matrix takes its K type), and an exact GPTQ v1 -> v2
conversion gives KL exactly 0 in the runtime that owns GPTQ (gptqmodel)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import llama_logits, run_cli, transformers_logits
from test_gguf_presets import model_dir

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/run_tests.sh")
pytest.importorskip("gptqmodel", reason="gptqmodel is installed by scripts/run_tests.sh")


@pytest.fixture(scope="module")
def wide_ggufs(tmp_path_factory):
    """A dense qwen3 model 256 wide and its Q8_0, Q4_0 and Q2_K files (our writer, --allow-requant)."""
    src = model_dir("qwen3")
    d = tmp_path_factory.mktemp("wide")
    outs = {}
    for t in ("q8_0", "q4_0", "q2_k"):
        outs[t] = d / f"{t}.gguf"
        run_cli("hf->gguf", src, outs[t], "--type", t, "--allow-requant", "--quiet")
    return src, outs


def _verify(src, out, report, *args):
    proc = run_cli("verify", src, out, "--logits", "--quiet", "--report", report, *args)
    return json.loads(report.read_text()), proc


def test_kl_grows_with_the_quantization_loss(wide_ggufs, tmp_path):
    src, outs = wide_ggufs
    figures = {}
    for t, out in outs.items():
        report, proc = _verify(src, out, tmp_path / f"{t}.json")
        lg = report["logits"]
        assert lg["source_runtime"].startswith("transformers ") and lg["output_runtime"].startswith("llama.cpp")
        assert lg["prompts"] == 1 and lg["tokens"] == 128  # the bundled text, cut at --max-tokens' default
        assert "logits over 128 tokens" in proc.stdout and "top-1 agreement" in proc.stdout
        figures[t] = lg
    kl = [figures[t]["kl_mean"] for t in ("q8_0", "q4_0", "q2_k")]
    assert 0 < kl[0] < kl[1] < kl[2], kl
    assert figures["q8_0"]["top1_agreement"] > figures["q2_k"]["top1_agreement"]
    # the source's perplexity is the same number in every report (the same model, text and runtime)
    assert len({figures[t]["ppl_source"] for t in figures}) == 1
    for lg in figures.values():
        assert lg["kl_max"] >= lg["kl_mean"] and 0 <= lg["top1_agreement"] <= 1 and lg["ppl_output"] > 1


def test_figures_equal_an_independent_computation(wide_ggufs, tmp_path):
    """Two prompts from a file: the report's figures equal torch's kl_div, argmax and cross-entropy over the
    logits of the two runtimes, computed here from the same ids."""
    src, outs = wide_ggufs
    prompts = ["The baker opened the shop before dawn and lit the oven.",
               "Numbers, like 3.14 and 42, and punctuation: commas; colons!"]
    (tmp_path / "p.txt").write_text("\n\n".join(prompts) + "\n")
    report, _ = _verify(src, outs["q4_0"], tmp_path / "r.json", "--prompts", tmp_path / "p.txt")
    lg = report["logits"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    kls, agree, nll_s, nll_o, n = [], 0, 0.0, 0.0, 0
    for p in prompts:
        ids = tok(p)["input_ids"]
        s = torch.log_softmax(torch.from_numpy(transformers_logits(src, ids)).double(), -1)
        o = torch.log_softmax(torch.from_numpy(llama_logits(outs["q4_0"], ids)).double(), -1)
        kls.append(torch.nn.functional.kl_div(o, s, log_target=True, reduction="none").sum(-1))
        agree += int((s.argmax(-1) == o.argmax(-1)).sum())
        target = torch.tensor(ids[1:])
        nll_s += float(torch.nn.functional.nll_loss(s[:-1], target, reduction="sum"))
        nll_o += float(torch.nn.functional.nll_loss(o[:-1], target, reduction="sum"))
        n += len(ids) - 1
    kl = torch.cat(kls)
    assert lg["prompts"] == 2 and lg["tokens"] == kl.numel()
    np.testing.assert_allclose(lg["kl_mean"], float(kl.mean()), rtol=1e-6)
    np.testing.assert_allclose(lg["kl_max"], float(kl.max()), rtol=1e-6)
    assert lg["top1_agreement"] == agree / kl.numel()
    np.testing.assert_allclose([lg["ppl_source"], lg["ppl_output"]], [np.exp(nll_s / n), np.exp(nll_o / n)],
                               rtol=1e-6)


def test_an_exact_gptq_v1_to_v2_conversion_has_zero_kl(fx, tmp_path):
    src = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    run_cli("gptq->gptq-v2", src, tmp_path / "v2", "--quiet")
    report, proc = _verify(src, tmp_path / "v2", tmp_path / "r.json")
    lg = report["logits"]
    assert lg["source_runtime"] == lg["output_runtime"] and lg["source_runtime"].startswith("gptqmodel ")
    assert lg["kl_mean"] == 0.0 and lg["kl_max"] == 0.0 and lg["top1_agreement"] == 1.0
    assert lg["ppl_source"] == lg["ppl_output"]
    assert {k: v for k, v in report["summary"]["verdicts"].items() if v} == {"exact": 21}
    assert "GPT-QModel" not in proc.stdout + proc.stderr  # the runtime's banner stays off the terminal


def _one_line_error(proc) -> str:
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err and err[-1].startswith("qconvert: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return err[-1]


def test_a_runtime_that_is_not_installed_is_refused_naming_the_package(wide_ggufs, tmp_path):
    src, outs = wide_ggufs
    code = ("import sys; sys.modules['llama_cpp'] = None; from qconvert.converters.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "verify", str(src), str(outs["q8_0"]), "--logits"],
                          capture_output=True, text=True)
    line = _one_line_error(proc)
    assert "llama-cpp-python, which is not installed (pip install llama-cpp-python)" in line


def test_uqff_and_bad_prompts_are_one_line_refusals(fx, tmp_path):
    src = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    run_cli("gptq->uqff", src, tmp_path / "u", "--quiet")
    line = _one_line_error(run_cli("verify", src, tmp_path / "u", "--logits", check_rc=None))
    assert "cannot run a UQFF model" in line and "mistral.rs" in line
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    line = _one_line_error(run_cli("verify", src, tmp_path / "u", "--logits", "--prompts", tmp_path / "empty.txt",
                                   check_rc=None))
    assert "empty.txt" in line and "no prompts" in line
    line = _one_line_error(run_cli("verify", src, tmp_path / "u", "--prompts", tmp_path / "empty.txt",
                                   check_rc=None))
    assert "--prompts is for --logits" in line
