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
from wide_models import model_dir

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


def _assert_loss_grows(figures: dict, types: tuple[str, str, str]) -> None:
    """KL grows with the quantization loss of `types` (lightest first), top-1 agreement falls, and the source's
    perplexity is the same number in every report (the same model, text and runtime)."""
    kl = [figures[t]["kl_mean"] for t in types]
    assert 0 < kl[0] < kl[1] < kl[2], kl
    assert figures[types[0]]["top1_agreement"] > figures[types[-1]]["top1_agreement"]
    assert len({f["ppl_source"] for f in figures.values()}) == 1
    for lg in figures.values():
        assert lg["kl_max"] >= lg["kl_mean"] and 0 <= lg["top1_agreement"] <= 1 and lg["ppl_output"] > 1


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
    _assert_loss_grows(figures, ("q8_0", "q4_0", "q2_k"))


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


def _verify_logits_without(module: str, src, out) -> subprocess.CompletedProcess:
    """`qconvert verify SRC OUT --logits` in a process where `module` cannot be imported (as if not installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None; from qconvert.converters.apps.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "verify", str(src), str(out), "--logits"],
                          capture_output=True, text=True)


def test_a_runtime_that_is_not_installed_is_refused_naming_the_package(wide_ggufs, tmp_path):
    src, outs = wide_ggufs
    line = _one_line_error(_verify_logits_without("llama_cpp", src, outs["q8_0"]))
    assert "llama-cpp-python, which is not installed (pip install llama-cpp-python)" in line


def test_bad_prompts_are_one_line_refusals(fx, tmp_path):
    src = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    run_cli("gptq->uqff", src, tmp_path / "u", "--quiet")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    line = _one_line_error(run_cli("verify", src, tmp_path / "u", "--logits", "--prompts", tmp_path / "empty.txt",
                                   check_rc=None))
    assert "empty.txt" in line and "no prompts" in line
    line = _one_line_error(run_cli("verify", src, tmp_path / "u", "--prompts", tmp_path / "empty.txt",
                                   check_rc=None))
    assert "--prompts is for --logits" in line


# -- UQFF: mistral.rs, by teacher forcing on prefixes, top-K ---------------------------------------------------
@pytest.fixture(scope="module")
def wide_uqffs(tmp_path_factory):
    """The dense f32 Llama 256 wide that mistral.rs runs (tests/support/fixtures_uqff.py) and our hf -> uqff outputs
    of it: q8_0, q4_0, q2k (requantized) and f32 (inline Unquant layers: the same weights)."""
    pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")
    import fixtures_uqff as FU

    src = FU.ensure_uqff_fixtures()["wide"]
    d = tmp_path_factory.mktemp("wide_uqff")
    outs = {}
    for t in ("q8_0", "q4_0", "q2k", "f32"):
        outs[t] = d / t
        run_cli("hf->uqff", src, outs[t], "--type", t, "--allow-requant", "--quiet")
    return src, outs


def test_uqff_kl_grows_with_the_quantization_loss_over_mistralrs_top_k(wide_uqffs, tmp_path):
    src, outs = wide_uqffs
    figures = {}
    for t in ("q8_0", "q4_0", "q2k"):
        report, proc = _verify(src, outs[t], tmp_path / f"{t}.json")
        lg = report["logits"]
        assert lg["source_runtime"].startswith("transformers ") and lg["output_runtime"].startswith("mistral.rs")
        # mistral.rs returns all 512 log-probs when asked for them: the full-vocabulary figures
        assert lg["support"] == "full vocabulary", lg["support"]
        # every prefix of the bundled text round-trips through mistral.rs' tokenizer: all 128 positions compared
        assert lg["positions_skipped"] == 0 and lg["tokens"] == 128, lg
        assert "logits over 128 tokens" in proc.stdout and "all log-probs of 1 generated token" in proc.stdout
        figures[t] = lg
    _assert_loss_grows(figures, ("q8_0", "q4_0", "q2k"))
    for lg in figures.values():
        assert lg["ppl_source_unscored"] == lg["ppl_output_unscored"] == 0


def test_a_top_k_of_mistralrs_estimates_kl_and_keeps_top1_exact(wide_uqffs):
    """Asked for its top-20 only, mistral.rs gives the same top-1 agreement as with its whole vocabulary, a
    KL over the top-20 (both sides renormalised) of the same order, and no perplexity where a true next
    token falls outside the 20."""
    from qconvert.converters.apps import logits as quality
    from qconvert.converters.apps.runtimes import MistralRsRuntime, register_runtime

    src, outs = wide_uqffs
    full = quality.compare_logits("hf", src, "uqff", outs["q4_0"], [quality.bundled_text()])
    register_runtime("uqff", lambda p, f: MistralRsRuntime(p, f, top_k=20))
    try:
        top = quality.compare_logits("hf", src, "uqff", outs["q4_0"], [quality.bundled_text()])
    finally:
        register_runtime("uqff", MistralRsRuntime)
    assert full.support == "full vocabulary" and top.support == "top-20 of mistral.rs (output)"
    assert top.tokens == full.tokens == 128 and top.top1_agreement == full.top1_agreement
    assert 0 < top.kl_mean and 0.1 < top.kl_mean / full.kl_mean < 10, (top.kl_mean, full.kl_mean)
    assert top.ppl_source == full.ppl_source
    assert top.ppl_output_unscored > 0 and top.ppl_output is None  # 512 tokens, near-uniform: many outside
    assert "n/a (true token outside the top-K at" in top.line()


def test_an_exact_f32_uqff_has_kl_near_zero_in_mistralrs(wide_uqffs, tmp_path):
    """Unquant F32 layers: the source's weights in mistral.rs' F32 CPU matmul; only float order differs."""
    src, outs = wide_uqffs
    report, _ = _verify(src, outs["f32"], tmp_path / "r.json")
    lg = report["logits"]
    assert lg["positions_skipped"] == 0 and lg["tokens"] == 128
    # measured: KL max 3.1e-13 (mistral.rs' f32 log-probs against transformers' float64 log-softmax)
    assert lg["kl_max"] < 1e-10 and lg["top1_agreement"] == 1.0, lg
    np.testing.assert_allclose(lg["ppl_output"], lg["ppl_source"], rtol=1e-6)


def test_mistralrs_top_k_equals_a_direct_mistralrs_call(wide_uqffs, tmp_path):
    """The runtime's last position (the whole prompt) equals mistral.rs asked directly, in the tests' own
    runner (tests/support/fixtures_uqff.py: its own subprocess, the model's chat template, top-3)."""
    import fixtures_uqff as FU
    from qconvert.converters.apps.runtimes import MistralRsRuntime

    out = wide_uqffs[1]["q4_0"]
    direct = FU.mistralrs_logprobs(out, tmp_path / "lp.json", from_uqff="q4_0-0.uqff", steps=1)
    runtime = MistralRsRuntime(out, "uqff")
    try:
        assert runtime.tokenize(FU.PROMPT_TEXT) == direct["ids"]
        top = runtime.log_probs(direct["ids"])
    finally:
        runtime.close()
    assert len(top.rows) == len(direct["ids"]) and all(r is not None for r in top.rows)
    tokens, logprobs = top.rows[-1]
    assert len(tokens) == 512 and np.all(np.diff(logprobs) <= 0)  # the whole vocabulary, most likely first
    np.testing.assert_allclose(np.exp(logprobs).sum(), 1.0, atol=1e-6)
    want = direct["steps"][0]
    assert [int(t) for t in tokens[:3]] == [t for t, _ in want]
    np.testing.assert_allclose(logprobs[:3], [lp for _, lp in want], atol=1e-5)


def test_uqff_as_the_source_against_its_gguf_copy(wide_uqffs, tmp_path):
    """uqff -> gguf copies the GGUF blocks: the source side is mistral.rs' top-K, the output llama.cpp."""
    out = wide_uqffs[1]["q4_0"]
    gguf = tmp_path / "m.gguf"
    run_cli("uqff->gguf", out, gguf, "--quiet")
    report, _ = _verify(out, gguf, tmp_path / "r.json")
    lg = report["logits"]
    assert lg["source_runtime"].startswith("mistral.rs") and lg["output_runtime"].startswith("llama.cpp")
    assert lg["support"] == "full vocabulary" and lg["positions_skipped"] == 0
    # the same Q4_0 blocks in two engines: their kernels' rounding only
    assert lg["kl_mean"] < 1e-4 and lg["top1_agreement"] > 0.95, lg
    assert lg["ppl_output_unscored"] == 0 and lg["ppl_output"] > 1


def test_kl_on_shared_tokens_is_the_renormalised_kl_over_the_top_k():
    """The estimator against torch: KL of the two distributions renormalised over the output's top-K; with
    K = the vocabulary it is the full KL of kl_rows."""
    from qconvert.converters.apps.logits import kl_on_shared_tokens, kl_rows

    gen = torch.Generator().manual_seed(3)
    s = torch.log_softmax(torch.randn(64, generator=gen, dtype=torch.float64) * 2, -1)
    o = torch.log_softmax(s + 0.3 * torch.randn(64, generator=gen, dtype=torch.float64), -1)
    top = torch.topk(o, 20).indices
    ps, qs = torch.log_softmax(s[top], -1), torch.log_softmax(o[top], -1)
    want = float(torch.nn.functional.kl_div(qs, ps, log_target=True, reduction="sum"))
    full = (np.arange(64), s.numpy())
    got = kl_on_shared_tokens(full, (top.numpy(), o[top].numpy()))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(kl_on_shared_tokens(full, (np.arange(64)[::-1].copy(), o.numpy()[::-1].copy())),
                               kl_rows(s.numpy()[None], o.numpy()[None])[0], rtol=1e-12)
    assert kl_on_shared_tokens((np.array([1, 2]), np.log([0.5, 0.5])), (np.array([3]), np.array([0.0]))) is None


def test_a_uqff_mistralrs_cannot_run_is_a_one_line_refusal(wide_uqffs, tmp_path):
    import shutil

    from qconvert.converters.errors import QConvertError
    from qconvert.converters.apps.runtimes import MistralRsRuntime

    src, outs = wide_uqffs
    proc = _verify_logits_without("mistralrs", src, outs["q4_0"])
    assert "mistralrs, which is not installed (pip install mistralrs)" in _one_line_error(proc)
    # what mistral.rs needs and the folder lacks is named; the user's folder is left as it is
    norope = tmp_path / "norope"
    shutil.copytree(outs["q4_0"], norope)
    cfg = json.loads((norope / "config.json").read_text())
    del cfg["rope_theta"]
    (norope / "config.json").write_text(json.dumps(cfg))
    line = _one_line_error(run_cli("verify", src, norope, "--logits", check_rc=None))
    assert "config.json" in line and "needs a top-level rope_theta" in line
    assert "rope_theta" not in json.loads((norope / "config.json").read_text())
    # mistral.rs failing inside its own process: its error, in one line, and qconvert still standing
    broken = tmp_path / "broken"
    shutil.copytree(outs["q4_0"], broken)
    shard = broken / "q4_0-0.uqff"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(QConvertError, match=r"mistral\.rs cannot load the model \(exit \d+: .+\)") as err:
        MistralRsRuntime(broken, "uqff")
    assert "\n" not in str(err.value)
