"""`hf->mlx` for the architectures of issue 26, judged by mlx-lm 0.32 itself (.venvs/mlx, tests/support/mlx_driver.py).

The sources are the tiny random models of tests/support/fixtures_archs.py, cached under tests/_fixtures/archs by the
GGUF architecture tests (the same folders: whichever test runs first builds them). Each is converted with
`--type mlx4g64 --allow-requant` (mlx's affine rule, bit for bit mx.quantize), then one mlx process loads every
output (`load-many`: mlx-lm imported once). Per architecture:
- mlx-lm loads the folder with every linear quantized as written (4-bit affine) and `mx.dequantize` of each module
  equals our reader's decoding of it bit for bit;
- mlx-lm's logits on the prompt equal transformers' (float32, eager) on our reader's `mlx->hf` of the same folder
  within the existing mlx tests' tolerance (0.05 of the logit range); measured: below 1e-5 of a range of ~7 (float32
  on both sides).

Which architectures mlx-lm 0.32 loads and which it does not (and the error) is docs/formats.md's table; the writer
adds the config keys mlx-lm requires (formats/mlx/configs.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_arch_files import cached as _cached

REPO = Path(__file__).resolve().parents[3]
MLX_PY = REPO / ".venvs" / "mlx" / "bin" / "python"
DRIVER = Path(__file__).parents[2] / "support" / "mlx_driver.py"
ROOT = Path(__file__).parents[2] / "_fixtures" / "archs"
LOGIT_TOLERANCE = 0.05  # fraction of the reference's logit range, as tests/formats/mlx/test_mlx.py

_spec = importlib.util.spec_from_file_location("fixtures_archs",
                                               Path(__file__).parents[2] / "support" / "fixtures_archs.py")
fixtures_archs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures_archs)
PROMPT = fixtures_archs.arch_prompt()

# case -> (kind, the cached folder the GGUF architecture tests build, build_arch_model's keywords, --type or None,
# whether mlx-lm's logits are transformers' on the same weights)
CASES = {
    "mistral3": ("mistral3", "std-mistral3", {}, "mlx4g64", True),
    "smollm3": ("smollm3", "std-smollm3", {}, "mlx4g64", True),
    "olmo2": ("olmo2", "std-olmo2", {}, "mlx4g64", True),
    "olmo3": ("olmo3", "std-olmo3", {}, "mlx4g64", True),
    "exaone4": ("exaone4", "std-exaone4", {}, "mlx4g64", True),
    "glm4_moe": ("glm4_moe", "std-glm4_moe", {}, "mlx4g64", True),
    "qwen3_5": ("qwen3_5", "hybrid-qwen3_5", {}, "mlx4g64", True),
    # MoE: the experts written stacked as mlx-lm's switch layers (formats/mlx/experts.py)
    "qwen3_5_moe": ("qwen3_5_moe", "hybrid-qwen3_5_moe", {}, "mlx4g64", True),
    "ernie4_5_moe": ("ernie4_5_moe", "std-ernie4_5_moe", {}, "mlx4g64", True),
    "minimax_m2": ("minimax_m2", "std-minimax_m2", {}, "mlx4g64", True),
    "qwen3_next": ("qwen3_next", "hybrid-qwen3_next", {}, "mlx4g64", True),
    # older MoE architectures whose experts are now written stacked too (Qwen3-MoE also needs `num_experts` and
    # `head_dim` in config.json; Mixtral's w1/w2/w3 experts are quantized as mlx-lm's gate/down/up switch layers)
    "qwen3_moe": ("qwen3_moe", "qwen3_moe", {}, "mlx4g64", True),
    "mixtral": ("mixtral", "mixtral", {}, "mlx4g64", True),
    # GLM-5 with two layers, so that both have their own indexer (the GGUF tests' three-layer model ends with a
    # "shared" indexer layer, which mlx-lm 0.32's GLM-5 does not have: "Missing 5 parameters:
    # model.layers.2.self_attn.indexer..."). mlx-lm splits kv_b_proj per head at load (its MLA absorption) and
    # quantizes a quantized one again, after dequantizing it, with the config's bits and group (group 32 here:
    # the tiny model's qk_nope_head_dim is 32): so its 4-bit GLM-5 is not the weights written (logits 1.06 off
    # transformers' on them, range 7.6). The 4-bit case checks every other module and that mlx-lm runs it;
    # the float case (no --type) that mlx-lm's GLM-5 is transformers' model on the same weights.
    "glm_moe_dsa": ("glm_moe_dsa", "runtimes-glm_moe_dsa-2layers", {"layers": 2}, "mlx4g32", False),
    "glm_moe_dsa-float": ("glm_moe_dsa", "runtimes-glm_moe_dsa-2layers", {"layers": 2}, None, True),
}
# mlx-lm 0.32's ERNIE 4.5 drops the router's correction bias and routes by the gate's softmax alone (transformers:
# the top k of softmax + bias), so it is transformers' model where that bias is zero: its logits are compared with
# transformers' on our weights with the bias zeroed (with the fixture's random bias they are 1.55 off, range 7.9)
ROUTING_IGNORED = {"ernie4_5_moe": "e_score_correction_bias"}


def _mlx_ready() -> bool:
    if not MLX_PY.exists():
        return False
    proc = subprocess.run([str(MLX_PY), "-c", "import mlx.core, mlx_lm, safetensors"], capture_output=True)
    return proc.returncode == 0


pytestmark = pytest.mark.skipif(not _mlx_ready(), reason="mlx environment missing: bash scripts/test_env.d/40-mlx.sh")


def source_dir(case: str) -> Path:
    kind, name, kw, _, _ = CASES[case]
    return _cached(ROOT / name, lambda d: fixtures_archs.build_arch_model(d, kind, **kw))


def _convert(src_fmt, src, dst_fmt, out, **kw):
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    return convert(src_fmt, Path(src), dst_fmt, Path(out), Options(**kw), progress=False)


@pytest.fixture(scope="module")
def mlx_runs(tmp_path_factory):
    """{kind: (mlx folder, conversion report, mlx-lm's tensors, its summary)}: every case converted, then loaded
    by one mlx process."""
    from safetensors.numpy import load_file

    tmp = tmp_path_factory.mktemp("mlx_archs")
    outs, reports, jobs = {}, {}, []
    for case, (_, _, _, type_, _) in CASES.items():
        outs[case] = tmp / case
        reports[case] = _convert("hf", source_dir(case), "mlx", outs[case], type=type_, allow_requant=bool(type_))
        jobs.append([str(outs[case]), str(tmp / f"{case}.mlx.safetensors"), PROMPT, 0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(MLX_PY), str(DRIVER), "load-many", json.dumps(jobs)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"mlx-lm failed:\n{proc.stderr[-3000:]}"
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == len(CASES)
    return {case: (outs[case], reports[case], load_file(jobs[i][1]), summaries[i]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_mlx_runs_in_mlx_lm(mlx_runs, tmp_path, case):
    from qconvert.formats.mlx.reader import MlxSource

    _, _, _, type_, same_model = CASES[case]
    out, report, got, summary = mlx_runs[case]
    layers = [r for r in report.results if r.plan.name.endswith("_proj.weight") and not r.plan.name.startswith("mtp.")]
    if type_ is None:  # float: every tensor copied, mlx-lm quantizes nothing
        assert {r.plan.verdict for r in report.results} == {"exact"} and not summary["quantized"]
    else:
        # every linear requantized with mlx's rule (an MTP block, which mlx-lm drops at load, is copied as it
        # is); mlx-lm built each of them as a 4-bit affine QuantizedLinear
        group = int(type_.split("g")[-1])
        assert layers and {r.plan.verdict for r in layers} == {"requantize"}
        assert summary["quantized"] and {(q["bits"], q["group_size"], q["mode"])
                                         for q in summary["quantized"].values()} == {(4, group, "affine")}
        # mlx decodes what our reader decodes, bit for bit, in every QuantizedLinear / QuantizedEmbedding /
        # QuantizedSwitchLinear the driver reads back, and every grid our reader reads is one of them (mlx-lm's
        # Qwen3.5 module names carry the multimodal model's `language_model.` prefix; GLM-5's kv_b_proj, which
        # mlx-lm splits and quantizes again, is the exception: the case's same_model is False)
        source = MlxSource(out)
        ours = {r.name: r for r in source.records() if r.is_grid}
        compared = {name: name.removeprefix("language_model.") for name in got if not name.startswith("__")}
        assert len(compared) == len(summary["quantized"])
        seen = set()
        for mlx_name, name in compared.items():
            # a switch layer (a MoE layer's experts, stacked) is [experts, out, in]: our reader's records are its
            # experts, named as Hugging Face names them
            stack = got[mlx_name] if got[mlx_name].ndim == 3 else None
            for e, want in enumerate(stack if stack is not None else [got[mlx_name]]):
                ours_name = source.layout.expert_name(name, e) if stack is not None else name
                assert ours_name in ours, ours_name
                assert np.array_equal(ours[ours_name].load().dequantize(torch.float32).numpy(), want), ours_name
                seen.add(ours_name)
        # every routed expert we wrote is one mlx-lm runs; it drops the MTP blocks at load: Qwen's `mtp.*`, and
        # GLM's layers after the trunk (model.layers.<num_hidden_layers + i>, which a fresh fixture build has)
        trunk = json.loads((out / "config.json").read_text())
        trunk = trunk.get("text_config", trunk)["num_hidden_layers"]
        unseen = sorted(n for n in set(ours) - seen if ".experts." in n and not n.startswith("mtp.")
                        and not (n.startswith("model.layers.") and int(n.split(".")[2]) >= trunk))
        assert not unseen, unseen[:4]
    if not same_model:
        return
    # mlx-lm's model is transformers' model on the same weights (our reader's dequantization of the folder; a
    # float folder holds the source's own)
    if type_ is None:
        weights = source_dir(case)
    else:
        weights = tmp_path / "hf"
        _convert("mlx", out, "hf", weights, type="f32")
        if case in ROUTING_IGNORED:
            from safetensors.torch import load_file, save_file

            for shard in weights.glob("*.safetensors"):
                tensors = load_file(str(shard))
                tensors = {k: torch.zeros_like(v) if k.endswith(ROUTING_IGNORED[case]) else v
                           for k, v in tensors.items()}
                save_file(tensors, str(shard), metadata={"format": "pt"})
    ref = np.asarray(fixtures_archs.transformers_logits(weights, PROMPT)).reshape(got["__logits__"].shape)
    span = float(ref.max() - ref.min())
    err = float(np.abs(got["__logits__"] - ref).max())
    assert err <= LOGIT_TOLERANCE * span, f"{case}: mlx-lm's logits {err:.4g} off transformers' (range {span:.2f})"
