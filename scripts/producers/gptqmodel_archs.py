"""Remake tests/producer_fixtures/gptq_<family>/: gptqmodel's own 4-bit group-32 GPTQ of the tiny models of the
issue-26 families (tests/support/fixtures_archs.py, the builders the architecture tests use).

    .venv/bin/python scripts/producers/gptqmodel_archs.py                 # every family in FAMILIES
    .venv/bin/python scripts/producers/gptqmodel_archs.py qwen3_5_moe glm4_moe

The producer is gptqmodel (the .venv's, on CPU: tests/support/fixtures.py quantize_gptq, its fixed calibration
set and seeds), symmetric 4 bits, group 32, desc_act off: the grid GGUF's Q4_0 holds, so every projection can
keep its codes. gptqmodel quantizes what its model definition lists for the family (attention, linear
attention, dense MLPs, every routed and shared expert, unfused to one module per expert); routers, norms, conv
kernels and embeddings stay float16. Beside each folder it stores the oracle, made by gptqmodel itself:
reference.safetensors = dequantize_weight() of every quantized module of the checkpoint loaded with its torch
backend (float16 [out, in], "<module>.weight"), logits.safetensors = that loaded model's logits on the
architecture tests' prompt (fixtures_archs.arch_prompt), and versions.json.

Each family runs in a child process of its own: loading a MoE with gptqmodel patches transformers for the rest
of the process. A family gptqmodel cannot quantize is reported with its error and the others go on; the exit
code says whether any failed. Quantizing takes 1-3 minutes per family on 2 CPU cores.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share (see its docstring)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()

# family (a fixtures_archs kind) -> the fixture folder's name; gptq_qwen35 keeps the name it had before the
# script covered more than Qwen3.5 (the fuzz seeds name it)
FAMILIES = {
    "qwen3_5": "gptq_qwen35",
    "qwen3_5_moe": "gptq_qwen35moe",
    "qwen3_next": "gptq_qwen3next",
    "glm4_moe": "gptq_glm4moe",
    "gemma4_moe": "gptq_gemma4moe",
    "mistral3": "gptq_mistral3",
    "smollm3": "gptq_smollm3",
    "olmo3": "gptq_olmo3",
    "exaone4": "gptq_exaone4",
    "glm_moe_dsa": "gptq_glm_dsa",
    "deepseek_v3": "gptq_deepseek_v3",  # not a 2026 family: the other user of the GGUF MLA split (attn_v_b's codes)
    # Llama 4 with every layer routed, as Scout is released (fixtures_archs.llama4_scout): gptqmodel's Llama 4
    # module tree has experts in every layer, and on the architecture tests' Maverick-style model (dense layers
    # 0 and 2) it stops at layer 0: "ValueError: layer module item `feed_forward.experts.0.gate_proj` not found
    # in model" (llm-compressor makes that layout: scripts/producers/llmcompressor_archs.py, ct_llama4_maverick);
    # its defuser needs the experts' layout told (_llama4_experts_in_out)
    "llama4_scout": "gptq_llama4",
    # DeepSeek-V4 from its release checkpoint decoded to float (fixtures_archs.deepseek_v4_dequantized: the FP4
    # experts decoded, the form transformers loads without a quantization config; gptqmodel does not read the
    # release's MXFP4 / FP8 form), quantized in bfloat16 (DTYPE); gptqmodel's module tree takes the attention's
    # q_a / q_b / kv / o_b projections and every routed and shared expert (of the hash-routed layer too)
    "deepseek_v4": "gptq_deepseek_v4",
}
# the families gptqmodel 7.6 cannot quantize with the .venv's transformers 5.24 (the error, as it fails):
# - minimax_m2: its definition names the experts block_sparse_moe.experts.#.w1/w3/w2, transformers 5.24 fuses them
#   under mlp.experts: nothing of the experts is quantized and the save keeps expert 0 alone, in float16 (the
#   converter refuses the folder: "expert 1 of 4 (and 2 more)" missing); llm-compressor makes it
#   (scripts/producers/llmcompressor_archs.py, ct_minimax_m2);
# - ernie4_5_moe: "AttributeError: 'Ernie4_5_MoeModel' object has no attribute '_update_causal_mask'" (its
#   definition calls transformers 4's mask helper);
# layers the architecture tests build each family with where it is not the builder's default
# (DeepSeek-V4: sliding, CSA and HCA layers, one of each; llama.cpp stops with a floating point exception
# (SIGFPE) on the 2-layer model of hidden 128, sliding and CSA, as on its unquantized release form)
LAYERS = {"gemma4_moe": 6, "glm_moe_dsa": 3, "deepseek_v4": 3}
# the dtype gptqmodel loads the base in, and its runtime the checkpoint in for the logits, where float16 is not it:
# transformers 5.24's DeepseekV4 keeps its compressor projections in float32 under float16 (its non-strict
# _keep_in_fp32_modules, meant for the FP8 release, has no effect in bfloat16 only), so the calibration forward in
# float16 fails in DeepseekV4CSACompressor: "RuntimeError: expected m1 and m2 to have the same dtype, but got:
# c10::Half != float" (modeling_deepseek_v4.py line 645, kv_proj). gptqmodel's torch kernel runs float16 and
# bfloat16 only ("TorchLinear only supports [torch.float16, torch.bfloat16]"), so not float32. The reference is
# still dequantize_weight() in float16 (the scales are stored float16 in either dtype: exact there)
DTYPE = {"deepseek_v4": "bfloat16"}
BITS, GROUP_SIZE, SYM = 4, 32, True


def _glm4_moe_router_tuple() -> None:
    """gptqmodel unfuses GLM-4.5's experts with defuser 0.0.28, whose LinearGlm4MoeMoE.route_tokens_to_experts
    takes the router's output for its logits; transformers 5.24's Glm4MoeTopkRouter already routes and returns
    (router_logits, topk_weights, topk_indices), so without this the calibration forward fails with
    "AttributeError: 'tuple' object has no attribute 'sigmoid'". The router's own choice is what the upstream
    model uses, so the quantized weights are what gptqmodel would make with the two versions agreeing."""
    from defuser.modeling.unfused_moe import glm4_moe

    route = glm4_moe.LinearGlm4MoeMoE.route_tokens_to_experts

    def route_tokens_to_experts(self, router_logits):
        if isinstance(router_logits, tuple):
            _, topk_weights, topk_indices = router_logits
            return topk_indices, topk_weights
        return route(self, router_logits)

    glm4_moe.LinearGlm4MoeMoE.route_tokens_to_experts = route_tokens_to_experts


def _llama4_experts_in_out() -> None:
    """gptqmodel unfuses Llama 4's experts with defuser 0.0.28, which reads a fused expert tensor's layout from the
    module's is_transposed and, where the module has none (transformers 5.24's Llama4TextExperts has none: its own
    forward multiplies hidden @ gate_up_proj), guesses it from the shape, [E, in, out] when in < out. The tiny
    model's gate_up_proj is [E, 128, 2 * 64], square per expert, so the guess is [E, out, in]: down_proj becomes a
    Linear(128 -> 64) and the calibration forward fails with "mat1 and mat2 shapes cannot be multiplied (64x64 and
    128x64)" (the released Scout, 5120 wide with 8192-wide experts, is guessed right). Llama4TextExperts stores
    [E, in, out]; saying so is the layout the guess gets for the released sizes."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    Llama4TextExperts.is_transposed = True


def _deepseek_v4_float(out: Path, kind: str, layers: int = 4) -> Path:
    """The architecture tests' DeepSeek-V4 (fixtures_archs.build_deepseek_v4, the release's layout) with its FP4
    experts decoded (deepseek_v4_dequantized): what transformers and gptqmodel load."""
    import fixtures_archs  # noqa: E402  (on sys.path: produce() put tests/support there)

    release = fixtures_archs.build_deepseek_v4(out.with_name("release"), layers=layers)
    return fixtures_archs.deepseek_v4_dequantized(release, out)


# the base of a family fixtures_archs.build_arch_model does not build
BUILD = {"deepseek_v4": _deepseek_v4_float}


# what a family needs before gptqmodel can run it with the .venv's transformers (a version mismatch, not a
# change of what is quantized)
BEFORE_QUANTIZING = {"glm4_moe": _glm4_moe_router_tuple, "llama4_scout": _llama4_experts_in_out}


def produce(kind: str) -> Path:
    support = _common.REPO / "tests" / "support"
    sys.path.insert(0, str(support))
    import fixtures  # noqa: E402  (tests/support: the calibration set and gptqmodel's quantize / load)
    import fixtures_archs  # noqa: E402
    import fixtures_moe  # noqa: E402  (moe_gptq_reference: gptqmodel's dequantization of every quant module)
    import torch
    from safetensors.torch import save_file

    out = _common.PRODUCER_FIXTURES / FAMILIES[kind]
    built_with = f", layers {LAYERS[kind]}" if kind in LAYERS else ""
    with tempfile.TemporaryDirectory(prefix=f"qconvert-gptq-{kind}-") as tmp:
        layers = {"layers": LAYERS[kind]} if kind in LAYERS else {}
        base = BUILD.get(kind, fixtures_archs.build_arch_model)(Path(tmp) / "base", kind, **layers)
        if kind in BEFORE_QUANTIZING:
            BEFORE_QUANTIZING[kind]()
        dtype = DTYPE.get(kind, "float16")
        ckpt = fixtures.quantize_gptq(base, Path(tmp) / "ckpt", bits=BITS, group_size=GROUP_SIZE, sym=SYM,
                                      dtype=dtype)
        # float16: gptqmodel dequantizes in float16, so nothing is lost (and the file is half the size)
        reference = {name: t.to(torch.float16).contiguous()
                     for name, t in fixtures_moe.moe_gptq_reference(ckpt).items()}
        logits = producer_logits(fixtures, ckpt, fixtures_archs.arch_prompt(), dtype)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        shutil.copytree(ckpt, out / "model")
        (out / "model" / "quant_log.csv").unlink(missing_ok=True)
        save_file(reference, str(out / "reference.safetensors"))
        save_file(logits, str(out / "logits.safetensors"))
        _common.write_versions(out, "gptqmodel", ["gptqmodel", "torch", "transformers"],
                               base=f"tests/support/fixtures_archs.py {kind} (seed 0{built_with})",
                               bits=BITS, group_size=GROUP_SIZE, sym=SYM,
                               **({"dtype": dtype} if kind in DTYPE else {}))
    return out


def producer_logits(fixtures, ckpt: Path, prompt, dtype: str = "float16") -> dict:
    """The producer's runtime on the checkpoint: gptqmodel's model (its torch kernel, CPU, in float16, or the
    family's DTYPE) run on the architecture tests' prompt. {"logits": float32 [T, vocab], "prompt": int64 [T]}:
    what llama.cpp's logits of the converted file are judged against."""
    import torch

    model = fixtures._load_quantized(ckpt, dtype).model.eval()
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float().contiguous()
    return {"logits": logits, "prompt": ids[0].contiguous()}


def main() -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("families", nargs="*", metavar="FAMILY", help=f"of {', '.join(FAMILIES)} (default: all)")
    ap.add_argument("--in-child", action="store_true", help=argparse_hidden())
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    _common.offline_defaults()
    families = args.families or list(FAMILIES)
    if args.in_child:
        print(produce(families[0]))
        return 0
    failed = []
    for kind in families:
        proc = subprocess.run([sys.executable, __file__, "--in-child", kind], env=_common.offline_env(),
                              capture_output=True, text=True)
        if proc.returncode == 0:
            print(f"{kind}: {proc.stdout.strip().splitlines()[-1]}")
        else:
            error = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            print(f"{kind}: FAILED: " + (" | ".join(error[-3:]) if error else str(proc.returncode)))
            failed.append(kind)
    return 1 if failed else 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
