"""`hf->uqff` for the architectures of issue 26 that mistral.rs 0.9.5 runs, judged by mistral.rs itself (PyPI
wheel, CPU).

mistral.rs 0.9.5's text models (`Which.Plain`) include four of the new architectures: SmolLM3 (SmolLm3), GLM-4.5
(GLM4Moe), Qwen3-Next (Qwen3Next) and Qwen3.5 dense (found from config.json); run unquantized on the tiny models
the first three give transformers' log-probabilities to 5e-6. The others it cannot load: see docs/formats.md's
table (the errors).

The sources are the tiny random models of tests/support/fixtures_archs.py, cached under tests/_fixtures/archs by the
GGUF architecture tests (the same folders). Each is converted with `--type q4_0 --allow-requant` (ggml's reference
quantizer; the routed experts of GLM-4.5 and Qwen3-Next stacked per projection as mistral.rs writes them), and one
mistral.rs process loads every output (`from_uqff`) and answers a greedy request with its top-3 log-probabilities.
The check is the existing UQFF tests' (test_uqff.py): transformers (float32) on our reader's `uqff->hf` of the same
folder, fed mistral.rs' prompt and chosen tokens, gives the same log-probabilities within 0.1 (mistral.rs' CPU GGUF
matmul quantizes the activations to Q8 first); measured 0.02-0.045.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import fixtures_uqff as FU
from gguf_arch_files import cached as _cached

mistralrs = pytest.importorskip("mistralrs", reason="mistralrs==0.9.5 is installed by scripts/test_env.d/30-mistralrs.sh")

ROOT = Path(__file__).parents[2] / "_fixtures" / "archs"
GGUF_TOL = 0.1  # as test_uqff.py: mistral.rs' CPU GGUF path quantizes activations to Q8

_spec = importlib.util.spec_from_file_location("fixtures_archs",
                                               Path(__file__).parents[2] / "support" / "fixtures_archs.py")
fixtures_archs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures_archs)

# kind -> (the cached folder the GGUF architecture tests build, mistral.rs' Architecture, experts per MoE layer)
CASES = {
    "smollm3": ("std-smollm3", "SmolLm3", 0),
    "glm4_moe": ("std-glm4_moe", "GLM4Moe", 4),
    "qwen3_next": ("hybrid-qwen3_next", "Qwen3Next", 4),
    # Qwen3.5's text model is no member of the wheel's Architecture enum (it lists Qwen3_5 among the multimodal
    # ones, which want a text_config and a vision tower), but mistral.rs' own choice from config.json's
    # architectures (Qwen3_5ForCausalLM) loads it as a text model
    "qwen3_5": ("hybrid-qwen3_5", "auto", 0),
}


def source_dir(kind: str) -> Path:
    return _cached(ROOT / CASES[kind][0], lambda d: fixtures_archs.build_arch_model(d, kind))


def _convert(src_fmt, src, dst_fmt, out, **kw):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    return convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)


_raw = FU.raw_tensors  # every tensor of a UQFF set, read with safetensors only


def widen_context_for_mistralrs(kind: str, out: Path) -> None:
    """mistral.rs 0.9.5's Qwen3-Next and Qwen3.5 ask for a cache of 522 positions at load and refuse a model whose
    max_position_embeddings is below it ("kv-cache: requested capacity (522) above max seq len (256)"): the tiny
    model's 256, not a released one's (262144). No rope scaling here, so the length changes nothing else."""
    if kind in ("qwen3_next", "qwen3_5"):
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = 4096
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def mistral_runs(tmp_path_factory):
    """{kind: (UQFF folder, conversion report, mistral.rs' greedy top-3 log-probabilities)}: every case converted,
    then run by one mistral.rs process."""
    tmp = tmp_path_factory.mktemp("uqff_archs")
    jinja = FU.chat_template_file(tmp / "chat.jinja")
    outs, reports, jobs = {}, {}, []
    for kind, (_, arch, _) in CASES.items():
        out = outs[kind] = tmp / kind
        reports[kind] = _convert("hf", source_dir(kind), "uqff", out, type="q4_0", allow_requant=True)
        widen_context_for_mistralrs(kind, out)
        jobs.append({"model_dir": out, "out_json": tmp / f"{kind}.json", "from_uqff": "q4_0-0.uqff", "jinja": jinja,
                     "arch": arch})
    results = FU.mistralrs_logprobs_many(jobs)
    return {kind: (outs[kind], reports[kind], results[i]) for i, kind in enumerate(CASES)}


@pytest.mark.parametrize("kind", list(CASES))
def test_hf_to_uqff_runs_in_mistralrs(mistral_runs, tmp_path, kind):
    out, report, mistral = mistral_runs[kind]
    assert "error" not in mistral, f"mistral.rs could not run our {kind} UQFF: {mistral['error']}"
    layers = [r for r in report.results if r.plan.name.endswith("_proj.weight") and not r.plan.name.startswith("mtp.")]
    assert layers and {r.plan.target for r in layers} == {"q4_0"} and {r.plan.verdict for r in layers} == {"requantize"}
    cfg = json.loads((out / "config.json").read_text())
    assert "rope_theta" in cfg  # mistral.rs reads it at the top level (transformers 5 writes rope_parameters)
    if kind == "glm4_moe":
        assert cfg["partial_rotary_factor"] == 0.5  # required by mistral.rs' GLM4Moe config
    experts = CASES[kind][2]
    if experts:  # the routed experts as mistral.rs stacks them: one [E, out, in] Q4_0 layer per projection
        raw = _raw(out)
        stacked = [k[: -len(".weight.shape")] for k in raw if ".experts." in k and k.endswith(".weight.shape")
                   and not k.startswith("mtp.")]
        assert stacked and all(raw[f"{k}.weight.shape"].tolist()[0] == experts for k in stacked), stacked[:3]
        assert not [k for k in raw if ".experts.0." in k]
    assert len(mistral["steps"]) == FU.STEPS
    _convert("uqff", out, "hf", tmp_path / "hf", type="f32")
    gap = FU.teacher_forced_gap(tmp_path / "hf", mistral, every_weight=True)
    assert gap < GGUF_TOL, f"{kind}: mistral.rs' log-probabilities {gap:.4g} off transformers' on the same weights"
