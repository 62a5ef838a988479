"""Issue 26 item 4: `gptq->uqff` from the new families' QUANTIZED sources, judged by mistral.rs 0.9.5 (PyPI wheel,
CPU).

The sources are tests/formats/gguf/test_gguf_archs_quantized.py's gptqmodel fixtures (4-bit group-32 symmetric,
float16, the producer's dequantization and logits beside each) of the four families mistral.rs runs
(test_uqff_archs.py's CASES: SmolLM3, GLM-4.5, Qwen3-Next, Qwen3.5). Each is converted without --type: GPTQ 4-bit
g32 sym is ggml's Q4_0 (d = the float16 scale, q - 8), so the writer keeps the codes as UQFF Q4_0 (the routed
experts stacked per projection, as mistral.rs writes them). One mistral.rs process loads every output
(`from_uqff`) and answers a greedy request with its top-3 log-probabilities. Per family:

- every module the producer quantized is in the report as q4_0, verdict exact, error 0;
- read back (`uqff->hf --type f32`), every one equals the producer's reference.safetensors once rounded to float16
  (the producer multiplies in float16);
- mistral.rs' log-probabilities are within test_uqff_archs.py's tolerance (0.1: its CPU Q4_0 matmul quantizes the
  activations to Q8) of transformers (float32) on the PRODUCER's model (tests/support/producer_archs.py: its
  reference weights, not ours read back), fed mistral.rs' prompt and chosen tokens. Not the producer's stored
  logits: those are for the architecture prompt's token ids, and mistral.rs' Python API takes text only (the
  byte-level ids do not decode to a text that encodes back to them); the producer's runtime is within 0.0007-0.0032
  of the logit range of transformers on those weights (gptqmodel float16 against float32, measured).

Not run: the other families of the fixtures, which mistral.rs 0.9.5 does not load (docs/formats.md's table:
"Unsupported Hugging Face Transformers -CausalLM model class ...").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fixtures_uqff as FU
import producer_archs as PA

G = PA.gguf_quantized_test()  # FIXTURES (family -> producer fixture folder)

# CASES (mistral.rs' architecture), GGUF_TOL, _convert, widen_context_for_mistralrs
UA = PA.test_module(Path(__file__).with_name("test_uqff_archs.py"))

CASES = [kind for kind in UA.CASES if kind in G.FIXTURES]


@pytest.fixture(scope="module")
def mistral_runs(tmp_path_factory):
    """{kind: (UQFF folder, conversion report, mistral.rs' greedy top-3 log-probabilities)}."""
    tmp = tmp_path_factory.mktemp("uqff_archs_quantized")
    jinja = FU.chat_template_file(tmp / "chat.jinja")
    outs, reports, jobs = {}, {}, []
    for kind in CASES:
        out = outs[kind] = tmp / kind
        reports[kind] = UA._convert("gptq", PA.PRODUCER_FIXTURES / G.FIXTURES[kind] / "model", "uqff", out)
        UA.widen_context_for_mistralrs(kind, out)
        jobs.append({"model_dir": out, "out_json": tmp / f"{kind}.json", "from_uqff": "q4_0-0.uqff", "jinja": jinja,
                     "arch": UA.CASES[kind][1]})
    results = FU.mistralrs_logprobs_many(jobs)
    return {kind: (outs[kind], reports[kind], results[i]) for i, kind in enumerate(CASES)}


@pytest.mark.parametrize("kind", CASES)
def test_gptq_to_uqff_keeps_codes_and_runs_in_mistralrs(mistral_runs, tmp_path, kind):
    from safetensors.torch import load_file

    fixture = PA.PRODUCER_FIXTURES / G.FIXTURES[kind]
    out, report, mistral = mistral_runs[kind]
    assert "error" not in mistral, f"mistral.rs could not run our {kind} UQFF: {mistral['error']}"
    reference = load_file(str(fixture / "reference.safetensors"))
    results = {r.plan.name: r for r in report.results}
    for name in reference:
        r = results[name]
        assert (r.plan.target, r.plan.verdict, r.max_abs_err) == ("q4_0", "exact", 0), (name, r.plan.reason)

    UA._convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    back = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        back.update(load_file(str(shard)))
    for name, want in reference.items():
        assert torch.equal(back[name].to(torch.float16), want), name

    assert len(mistral["steps"]) == FU.STEPS
    producer = PA.producer_folder(fixture, tmp_path / "producer")
    gap = FU.teacher_forced_gap(producer, mistral, every_weight=True)
    assert gap < UA.GGUF_TOL, f"{kind}: mistral.rs' log-probabilities {gap:.4g} off the producer's model"
