"""Issue 26 item 4: `gptq->mlx` / `ct->mlx` from the new families' QUANTIZED sources, judged by mlx-lm 0.32.

The sources are tests/formats/gguf/test_gguf_archs_quantized.py's producer fixtures (gptqmodel 7.6 GPTQ, and
llm-compressor's for ERNIE: 4-bit group-32 symmetric, float16, with the producer's dequantization and logits beside
each), for every family mlx-lm runs; each is converted without --type (the codes kept) twice, with scales and biases
in the model's float16 (the default) and in float32 (`--scale-dtype float32`), and one mlx process loads every
output (tests/support/mlx_driver.py `load-many`). Per family and scale dtype:

- every module the producer quantized is in the report as `mlx 4-bit g32` with its codes and scales kept and the
  bias -8*scale. In float32 it is exact, error 0: mlx decodes s*q + b in float32, which is s*(q - 8) unrounded. In
  float16 it is near-exact: the bias is exact in float16, but mlx decodes fp16(fp16(s*q) + b) (two roundings) where
  the producer decodes fp16(s*(q - 8)) (one); the report's measured error is that rounding (2.4e-4 to 4.9e-4 here,
  values below 1);
- mlx's own `mx.dequantize` of every quantized module (each expert of a switch layer included) is, bit for bit,
  the source's s*(q - 8) in float32 (rounded to float16: the producer's reference.safetensors exactly), or in
  float16 the formula above on the source's codes and scales (within test_mlx.py's fp16 bound of the reference;
  about half of the weights differ from it by one or two float16 ulps);
- mlx-lm's logits on the architecture prompt are within test_mlx.py's tolerance (0.05 of the logit range) of the
  producer runtime's logits.safetensors (measured: float32 0.0006-0.0029 of the range, float16 0.002-0.018). Two
  exceptions: ERNIE, whose mlx-lm model drops the router's correction bias (test_mlx_archs.py's ROUTING_IGNORED), is
  compared with transformers (float32) on the producer's own weights with that bias zeroed; Qwen3-Next's float16 run
  is 0.012-0.019 off until position 3, where it jumps to 0.64 (0.087 of the range: a near-tied top-k routing choice
  flipped in float16 arithmetic, which the recurrent linear attention carries on; its float32 run is 0.0017 off), so
  that one is judged as test_gguf_archs_quantized.py judges llama.cpp's MoE runs: the mean (0.018) and top-1
  agreement (15 of 16).

Not run (mlx-lm refuses them from the HF sources too, docs/formats.md): Gemma 4 ("[quantize] The requested group
size 256 is not supported": mlx-lm 0.32's gemma4_text builds the tiny model's full-attention layer wider than
transformers') and GLM-5, whose 3-layer fixture ends with a `shared` indexer layer mlx-lm has no module for
("Missing 5 parameters: model.layers.2.self_attn.indexer.k_norm.bias, ...") and Llama 4, in Scout's layout and in
Maverick's alike (mlx-lm reads `llama4_text` with a dense-only module: "Received ... parameters not in model:
model.layers.N.feed_forward.shared_expert..."; its MoE Llama 4 is the multimodal `llama4`) and DeepSeek-V4
(mlx-lm 0.32 has no such model: "ValueError: Model type deepseek_v4 not supported.").
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import producer_archs as PA
from qconvert.converters.model_shapes import canonical_name

G = PA.gguf_quantized_test()  # FIXTURES (test id, mostly the family -> producer fixture folder), FAMILY, PROMPT


# MLX_PY, DRIVER, LOGIT_TOLERANCE, ROUTING_IGNORED, _convert, fixtures_archs, pytestmark (whether .venvs/mlx runs)
MA = PA.test_module(Path(__file__).with_name("test_mlx_archs.py"))
MT = PA.test_module(Path(__file__).with_name("test_mlx.py"))  # _assert_kept_grid

# the families mlx-lm 0.32 does not load (module docstring)
NOT_RUN = ("gemma4_moe", "glm_moe_dsa", "llama4_scout", "llama4", "deepseek_v4")
# modules mlx-lm's sanitize does not load as written: DeepSeek-V3's kv_b_proj is dequantized there, split per head
# into embed_q / unembed_out and quantized again by mlx itself (models/deepseek_v3.py), as for any mlx folder of it
REBUILT_BY_MLX_LM = {"deepseek_v3": "self_attn.kv_b_proj"}
# each family twice: scales and biases in the model's float16 (the default) and in float32 (--scale-dtype)
SCALE_DTYPES = ("float16", "float32")
CASES = [f"{kind}-{dtype}" for kind in G.FIXTURES if G.FAMILY[kind] not in NOT_RUN for dtype in SCALE_DTYPES]
# a family whose float16 mlx-lm run flips a near-tied routing choice: judged on the mean and top-1 (docstring)
ROUTING_TIE = {"qwen3_next-float16"}

pytestmark = MA.pytestmark  # skipped (a failure with QCONVERT_REQUIRE_ORACLES=1) without the mlx environment


@pytest.fixture(scope="module")
def mlx_runs(tmp_path_factory):
    """{case: (mlx folder, conversion report, mlx-lm's tensors, its summary)}: every case converted (codes kept),
    then loaded by one mlx process."""
    from safetensors.numpy import load_file

    tmp = tmp_path_factory.mktemp("mlx_archs_quantized")
    outs, reports, jobs = {}, {}, []
    for case in CASES:
        kind, dtype = case.rsplit("-", 1)
        folder = G.FIXTURES[kind]
        outs[case] = tmp / case
        extra = {} if dtype == "float16" else {"scale_dtype": dtype}  # float16 is the fixtures' model dtype
        reports[case] = MA._convert(folder.split("_")[0], PA.PRODUCER_FIXTURES / folder / "model", "mlx", outs[case],
                                    extra=extra)
        jobs.append([str(outs[case]), str(tmp / f"{case}.mlx.safetensors"), G.PROMPT, 0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(MA.MLX_PY), str(MA.DRIVER), "load-many", json.dumps(jobs)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"mlx-lm failed:\n{proc.stderr[-3000:]}"
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == len(CASES)
    return {case: (outs[case], reports[case], load_file(jobs[i][1]), summaries[i]) for i, case in enumerate(CASES)}


def _mlx_formula(grid) -> torch.Tensor:
    """What mlx computes from a kept grid in a float16 model: fp16(fp16(s*q) + fp16(-s*z)), float32 values."""
    p = grid.params
    s = p.scales.to(torch.float16).repeat_interleave(p.group_size, dim=1)
    bias = (-(p.scales.float() * p.zeros.float())).to(torch.float16).repeat_interleave(p.group_size, dim=1)
    return ((s * grid.codes.to(torch.float16)) + bias).float()  # each float16 op rounds once


@pytest.fixture(scope="module")
def unbiased_producer_logits(tmp_path_factory):
    """kind -> transformers' (float32) logits of the producer's model with the routing tensor mlx-lm ignores
    zeroed (ROUTING_IGNORED), computed once for both scale dtypes."""
    cache = {}

    def logits(kind: str) -> np.ndarray:
        if kind not in cache:
            fixture = PA.PRODUCER_FIXTURES / G.FIXTURES[kind]
            weights = PA.producer_folder(fixture, tmp_path_factory.mktemp(f"producer-{kind}"),
                                         zeroed=MA.ROUTING_IGNORED[kind])
            cache[kind] = np.asarray(MA.fixtures_archs.transformers_logits(weights, G.PROMPT))
        return cache[kind]

    return logits


@pytest.mark.parametrize("case", CASES)
def test_quantized_checkpoint_keeps_its_codes_in_mlx(mlx_runs, unbiased_producer_logits, case):
    from safetensors.torch import load_file

    from qconvert.converters.registry import get_format
    from qconvert.formats.mlx.reader import MlxSource

    kind, dtype = case.rsplit("-", 1)
    folder = G.FIXTURES[kind]
    fixture = PA.PRODUCER_FIXTURES / folder
    out, report, got, summary = mlx_runs[case]
    config = json.loads((fixture / "model" / "config.json").read_text())
    # everything by the names the release gives them, as every writer names them (llm-compressor's MiniMax-M2
    # experts: gate_proj / up_proj / down_proj -> w1 / w3 / w2, converters/model_shapes.py)
    reference = {canonical_name(k, config): v for k, v in load_file(str(fixture / "reference.safetensors")).items()}
    results = {canonical_name(r.plan.name, config): r for r in report.results}
    for name in reference:  # every module the producer quantized: codes kept (float16: the error fp16 rounding)
        r = results[name]
        if dtype == "float32":
            assert (r.plan.target, r.plan.verdict, r.max_abs_err) == ("mlx 4-bit g32", "exact", 0), \
                (name, r.plan.reason)
        else:
            assert (r.plan.target, r.plan.verdict) == ("mlx 4-bit g32", "near-exact"), (name, r.plan.reason)
            assert r.max_abs_err < 2.0 ** -10, (name, r.max_abs_err)
    assert {(q["bits"], q["group_size"], q["mode"], q["dtype"]) for q in summary["quantized"].values()} == \
        {(4, 32, "affine", f"mlx.core.{dtype}")}

    source = {canonical_name(r.name, config): r
              for r in get_format(folder.split("_")[0]).open_reader(fixture / "model").records() if r.is_grid}
    layout = MlxSource(out).layout
    seen = set()
    for mlx_name, values in got.items():
        if mlx_name.startswith("__"):
            continue
        name = mlx_name.removeprefix("language_model.")  # mlx-lm's Qwen3.5 is the multimodal model's text part
        stack = values if values.ndim == 3 else None  # a switch layer: [experts, out, in]
        for e, want in enumerate(stack if stack is not None else [values]):
            hf_name = layout.expert_name(name, e) if stack is not None else name
            grid = source[hf_name].load()
            if dtype == "float32":  # s*(q - z) unrounded, the producer's dequantization before its fp16 rounding
                assert np.array_equal(want, grid.dequantize(torch.float32).numpy()), hf_name
                assert torch.equal(torch.from_numpy(want).to(torch.float16), reference[hf_name]), hf_name
            else:
                assert np.array_equal(want.astype(np.float32), _mlx_formula(grid).numpy()), hf_name
                s = grid.params.scales.float()
                MT._assert_kept_grid(want, reference[hf_name].float().numpy(), s, grid.params.group_size, 4, hf_name)
            seen.add(hf_name)
    rebuilt = {n for n in reference if REBUILT_BY_MLX_LM.get(kind, "@") in n}  # kept in our file (verdicts above)
    assert seen == set(reference) - rebuilt, sorted((set(reference) - rebuilt) ^ seen)[:4]  # mlx-lm runs the rest

    logits = got["__logits__"]
    if kind in MA.ROUTING_IGNORED:  # mlx-lm's model is not the producer's: transformers on its weights without it
        want = unbiased_producer_logits(kind).reshape(logits.shape)
    else:
        produced = load_file(str(fixture / "logits.safetensors"))
        assert produced["prompt"].tolist() == G.PROMPT
        want = produced["logits"].numpy().reshape(logits.shape)
    span = float(want.max() - want.min())
    gap = np.abs(logits - want)
    if case in ROUTING_TIE:
        assert gap.mean() < 0.05 and (logits.argmax(-1) == want.argmax(-1)).mean() >= 0.75, float(gap.mean())
    else:
        assert gap.max() <= MA.LOGIT_TOLERANCE * span, f"{case}: {float(gap.max()):.4g} off (range {span:.2f})"
