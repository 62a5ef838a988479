"""Remake tests/producer_fixtures/ct_<family>/: llm-compressor 0.14's own GPTQ (W4A16, symmetric, groups of 32) of
the tiny models of the issue-26 families gptqmodel 7.6 cannot quantize (scripts/producers/gptqmodel_archs.py says
why), and of DeepSeek-V4 from its float folder in the release's names (below), as compressed-tensors pack-quantized
checkpoints.

    .venv/bin/python scripts/producers/llmcompressor_archs.py               # every family in FAMILIES
    QCONVERT_LLMCOMPRESSOR_VENV=/path/to/venv .venv/bin/python scripts/producers/llmcompressor_archs.py

Two pythons: the base model is built here (the .venv's transformers 5.24: tests/support/fixtures_archs.py, the
builder the architecture tests use), then this script re-runs itself in llm-compressor's venv (transformers 5.17,
compressed-tensors 0.19; see compressed_tensors.py) to quantize. llm-compressor loads the model with its experts
linearized (llmcompressor.modeling.moe.linearize.load_quantizable_moe: one Linear per expert, so that every expert
is quantized) and runs GPTQModifier on seeded random calibration ids (every Linear but lm_head and the router).

Beside each folder, the producer's oracle: reference.safetensors = the weights its runtime computes with
(transformers 5.17 + compressed-tensors loading the checkpoint decompressed, CompressedTensorsConfig(
run_compressed=False), under load_quantizable_moe so that each expert is its own decompressed Linear), float16
[out, in] "<module>.weight" for every quantized Linear; logits.safetensors = that model's logits on the
architecture tests' prompt; versions.json.

MiniMax-M2 (minimax_m2) is saved with its experts as llm-compressor linearized them,
block_sparse_moe.experts.E.gate_proj/up_proj/down_proj: neither the release's w1/w3/w2 nor transformers' fused
names. transformers 5.17 and 5.24 (with compressed-tensors) do not read that layout (every expert is reported
missing and left at its initial weights); llm-compressor's own loader does, told the layout with its
patch_moe_mappings (the oracle below), and so does qconvert (converters/model_shapes.py names them as the release's
w1/w3/w2). The oracle's reference is keyed as the checkpoint names the modules.

Llama 4 (llama4) is the architecture tests' Maverick-layout text model (interleave_moe_layer_step 2: layers 0 and
2 dense, 1 and 3 routed), which gptqmodel 7.6 cannot quantize (its module tree has experts in every layer; it makes
the Scout layout, gptq_llama4). llm-compressor 0.14's Llama4 linearizer (modeling/moe/llama4.py,
Llama4LinearExperts.from_experts_module) reads config.text_config, which the text model's own config has not:
"AttributeError: 'Llama4TextConfig' object has no attribute 'text_config'" (for Llama4ForCausalLM and
Llama4ForConditionalGeneration alike); it is handed the text config as that (_llama4_text_config_linearizer), and
then every expert of the routed layers is its own quantized Linear, saved as feed_forward.experts.E.gate_proj/
up_proj/down_proj (the linearized names: neither the release's fused gate_up_proj/down_proj nor anything
transformers maps). llm-compressor has no load mapping for llama4_text, so its oracle builds the loaded model's
experts as llm-compressor's linearized module from the start (_llama4_per_expert_layout) and transformers +
compressed-tensors decompress each expert into it; the router (feed_forward.router, an nn.Linear subclass) stays
float, as MiniMax's and ERNIE's.

DeepSeek-V4 (deepseek_v4 -> ct_deepseek_v4; gptqmodel makes it too: gptq_deepseek_v4) is quantized from the float
form of the architecture tests' model with 3 layers (fixtures_archs.build_deepseek_v4 + deepseek_v4_dequantized:
sliding, CSA and HCA, the FP4 experts decoded, in the release's names; gptqmodel_archs.py's base) in float32:
transformers 5.17's own DeepseekV4 forward fails in float16 and bfloat16 ("RuntimeError: expected m1 and m2 to have
the same dtype, but got: float != c10::BFloat16" at self_attn.q_a_proj: the hyper-connection mix stays float32). Its
scales are computed in float16 (the weights' scale_dtype; WEIGHTS_MORE): a float32 model's are float32 otherwise,
which no Q4_0 block holds. Every Linear of the layers is quantized (68: the attention's, the compressors' and the
indexer's projections, every routed expert, linearized, and the shared expert; the routers stay float). The save
keeps the release's names under `model.` (`model.layers.N.attn.wq_a`, `model.layers.N.ffn.experts.E.w1`, `head.weight`)
beside transformers' `model.embed_tokens.weight` / `model.norm.weight` / `model.hc_head.*` (transformers 5.17 maps
the names back only in part) and writes its ignore list so (`model.layers.N.ffn.gate`, `lm_head`); qconvert's readers
rename them to transformers' (formats/common/checkpoint.py, formats/common/release_names.py quantized_release_names).
transformers 5.17 loads it back (its conversion mapping renames on load; every weight found) and runs it in float32:
the oracle, reference keyed by the checkpoint's names (_deepseek_v4_checkpoint_name), the first 256 rows of each
module (REFERENCE_ROWS: the indexer's wq_b has 4096).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share (see its docstring)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
VENV = Path(os.environ.get("QCONVERT_LLMCOMPRESSOR_VENV") or _common.REPO / ".venvs" / "llmcompressor")
PINS = ("torch==2.13.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0")
PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")
# family (a fixtures_archs kind) -> the fixture folder's name
FAMILIES = {"ernie4_5_moe": "ct_ernie45moe", "minimax_m2": "ct_minimax_m2", "llama4": "ct_llama4_maverick",
            "deepseek_v4": "ct_deepseek_v4"}
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
# what stays float: the head and the routers (ERNIE's mlp.gate)
IGNORE = ["lm_head", "re:.*\\.mlp\\.gate$"]
# a family's own routers, besides IGNORE (Llama 4's is feed_forward.router, an nn.Linear subclass)
IGNORE_MORE = {"llama4": ["re:.*\\.feed_forward\\.router$"]}
# DeepSeek-V4 (see the docstring): quantized and run in float32 (transformers 5.17's forward fails in float16 and
# bfloat16); its scales computed in float16 (compressed-tensors' scale_dtype; stored float32 as the model's dtype),
# as the other families' float16 models have them, so that GGUF's Q4_0 (a float16 scale per 32) holds the grid: with
# float32 scales every module is refused as lossy ("scales are not representable in fp16")
DTYPE = {"deepseek_v4": "float32"}
WEIGHTS_MORE = {"deepseek_v4": {"scale_dtype": "float16"}}
# the base model's layers where not the architecture tests' default (DeepSeek-V4: sliding, CSA and HCA, the base of
# gptq_deepseek_v4)
LAYERS = {"deepseek_v4": 3}
# the reference keeps a module's first rows only (each with all its groups), to stay within gptq_deepseek_v4's size:
# DeepSeek-V4's indexer wq_b has 4096 rows, half of the file alone; its other modules have at most 256
REFERENCE_ROWS = {"deepseek_v4": 256}


def _support():
    sys.path.insert(0, str(_common.REPO / "tests" / "support"))


def build_base(kind: str, out: Path) -> None:
    """In the .venv: the family's tiny model, as the architecture tests build it."""
    _support()
    import fixtures_archs  # noqa: E402

    if kind == "deepseek_v4":  # the release's layout with its FP4 experts decoded (gptqmodel_archs.py's base)
        release = fixtures_archs.build_deepseek_v4(out.with_name("release"), layers=LAYERS[kind])
        fixtures_archs.deepseek_v4_dequantized(release, out)
        return
    fixtures_archs.build_arch_model(out, kind)


def _weights(kind: str) -> dict:
    import torch

    more = {k: getattr(torch, v) if k == "scale_dtype" else v for k, v in WEIGHTS_MORE.get(kind, {}).items()}
    return {**WEIGHTS, **more}


def _dtype(kind: str):
    import torch

    return getattr(torch, DTYPE.get(kind, "float16"))


def calibration(n: int = 16, length: int = 64, seed: int = 2024):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 512, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * length] * n})


def _fixtures_tokenizer():
    """A tokenizer object for oneshot (which wants one beside a dataset; the ids above are already tokens): the
    fixtures' tokenizer.json, built in a temporary folder (the SentencePiece families ship no tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    _support()
    import fixtures  # noqa: E402

    folder = Path(tempfile.mkdtemp(prefix="qconvert-lc-tok-"))
    fixtures.build_tokenizer(folder)
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def _ignore(kind: str) -> list:
    return IGNORE + IGNORE_MORE.get(kind, [])


def produce(kind: str, base: Path, out: Path) -> None:
    """In llm-compressor's venv: GPTQ W4A16 g32 of `base` (experts linearized) saved compressed into `out`."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with BEFORE_LOADING.get(kind, contextlib.nullcontext)(), load_quantizable_moe():
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=_dtype(kind))
    recipe = GPTQModifier(ignore=_ignore(kind),
                          config_groups={"group_0": {"targets": ["Linear"], "weights": _weights(kind)}})
    oneshot(model=model, processor=_fixtures_tokenizer(), dataset=calibration(), recipe=recipe,
            num_calibration_samples=16, max_seq_length=64, pipeline="basic")
    model.save_pretrained(str(out), save_compressed=True)
    _common.copy_side_files(base, out, names=_common.SIDE_FILES + ("tokenizer.model",))
    (out / "recipe.yaml").unlink(missing_ok=True)


def _image_aliases_listable() -> None:
    """Loading into linearized experts swaps the experts class by transformers' apply_patches, which lists every
    transformers module with dir(): transformers 5.17's lazy aliases of the image processors
    (transformers.models.X.image_processing_X) import their target to be listed, and those import torchvision,
    which this CPU venv lacks (no CPU build of torchvision 0.28 is on the package indexes here; the CUDA one does
    not load against torch 2.13+cpu). The listing fails with "No module named 'torchvision'" before any weight
    is read. An alias whose target cannot be imported is listed as empty: it holds no class of a text model."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.") or getattr(module, "__file__", "") is not None:
            continue  # a real module (aliases have __file__ None)
        try:
            dir(module)
        except ImportError:
            module.__dir__ = lambda: []


def _minimax_m2_per_expert_layout():
    """llm-compressor's own declaration of a checkpoint whose experts are stored one Linear each
    (llmcompressor.modeling.patch_moe_mappings, the API its docs give for such a checkpoint): the saved
    block_sparse_moe.experts.E.gate_proj/up_proj/down_proj load as they are into the linearized experts, in
    place of transformers' Mixtral mapping, which only fuses the release's w1/w3/w2 (with it, the per-expert
    names load as nothing: every expert would keep its initial weights)."""
    from llmcompressor.modeling.moe.conversion_mappings import patch_moe_mappings
    from transformers.core_model_loading import WeightRenaming

    _image_aliases_listable()
    same = [WeightRenaming(rf"\.experts\.(\d+)\.{p}\.", rf".experts.\1.{p}.")
            for p in ("gate_proj", "up_proj", "down_proj")]
    return patch_moe_mappings("minimax_m2", same, remove_targets=[".experts.gate_up_proj", ".experts.down_proj"])


@contextlib.contextmanager
def _llama4_text_config_linearizer():
    """llm-compressor 0.14's Llama4LinearExperts.from_experts_module(experts, config) takes config.text_config for
    the text model's settings, as if every Llama 4 were the multimodal Llama4ForConditionalGeneration; linearize_moe
    hands it the model's config, which for the text model Llama4ForCausalLM is a Llama4TextConfig, and the load
    stops with "AttributeError: 'Llama4TextConfig' object has no attribute 'text_config'" before anything is
    quantized. The text config is what it wants: handed over as `text_config`, the linearizer runs as written."""
    from types import SimpleNamespace

    from compressed_tensors.utils import patch_attr
    from llmcompressor.modeling.moe.llama4 import Llama4LinearExperts

    linearize = Llama4LinearExperts.from_experts_module.__func__

    def from_experts_module(cls, experts, config):
        if not hasattr(config, "text_config"):
            config = SimpleNamespace(text_config=config)
        return linearize(cls, experts, config)

    with patch_attr(Llama4LinearExperts, "from_experts_module", classmethod(from_experts_module)):
        yield


@contextlib.contextmanager
def _llama4_per_expert_layout():
    """Loading llm-compressor's Llama 4 checkpoint back: its experts are saved as the linearized
    feed_forward.experts.E.gate_proj/up_proj/down_proj, and llm-compressor 0.14 has no load mapping for llama4_text
    (load_quantizable_moe would load the fused Llama4TextExperts, find none of those names, and linearize experts
    left at their initial weights). So each routed block is built with llm-compressor's own linearized module in
    its experts' place (Llama4LinearExperts, as load_quantizable_moe's direct path does for the families it maps),
    before any weight is read: every expert's Linear then has the checkpoint's names, and transformers +
    compressed-tensors decompress each into it. (Swapped after Llama4TextMoe's own __init__ rather than by
    transformers' patch mapping: Llama4LinearExperts is made from sizes, not from the config, and the model's
    _init_weights takes any module of the patched class name for the fused one.)"""
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modeling.moe.llama4 import Llama4LinearExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    build = Llama4TextMoe.__init__

    def __init__(self, config):
        build(self, config)
        self.experts = Llama4LinearExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                           config)

    with patch_attr(Llama4TextMoe, "__init__", __init__):
        yield


@contextlib.contextmanager
def _image_aliases_listed():
    """_image_aliases_listable as a context (DeepSeek-V4's experts are linearized through the same listing)."""
    _image_aliases_listable()
    yield


def _deepseek_v4_checkpoint_name(module: str) -> str:
    """A loaded DeepSeek-V4 module's name as llm-compressor's save names it: the release's name (fixtures_archs'
    renames, each routed expert's gate / up / down the release's w1 / w3 / w2) under `model.`, the head `head`."""
    _support()
    import fixtures_archs  # noqa: E402

    name = re.sub(r"\.experts\.(\d+)\.(gate|up|down)_proj$",
                  lambda m: f".experts.{m[1]}.{dict(gate='w1', up='w3', down='w2')[m[2]]}", module)
    release = fixtures_archs._dsv4_release_name(name + ".weight")[: -len(".weight")]
    return release if release == "head" else "model." + release


# what a family needs around llm-compressor's load for quantizing (a version mismatch, not a change of what is
# quantized)
BEFORE_LOADING = {"llama4": _llama4_text_config_linearizer, "deepseek_v4": _image_aliases_listed}
# how a family's checkpoint, as llm-compressor saved it, is loaded back by llm-compressor (a context manager
# around load_quantizable_moe), where its default (the architecture's transformers mapping) does not read it
CHECKPOINT_LAYOUT = {"minimax_m2": _minimax_m2_per_expert_layout, "llama4": _llama4_per_expert_layout,
                     "deepseek_v4": _image_aliases_listed}
# the loaded model's module names -> the checkpoint's, where transformers' mapping renames modules on load
# (MiniMax-M2's block_sparse_moe is the class's mlp; DeepSeek-V4's release names): the reference is keyed as the
# checkpoint names the modules
CHECKPOINT_NAMES = {"minimax_m2": lambda name: re.sub(r"\.mlp\.(experts|gate)\.", r".block_sparse_moe.\1.", name),
                    "deepseek_v4": _deepseek_v4_checkpoint_name}


def oracle(kind: str, ckpt: Path, prompt) -> tuple[dict, dict]:
    """In llm-compressor's venv: the runtime's decompressed weights (every quantized Linear, named as the
    checkpoint names it) and its logits on `prompt`."""
    import re

    import torch
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    with CHECKPOINT_LAYOUT.get(kind, contextlib.nullcontext)(), load_quantizable_moe():
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt), quantization_config=CompressedTensorsConfig(run_compressed=False),
            **({"dtype": _dtype(kind)} if kind in DTYPE else {})).eval()
    rename = CHECKPOINT_NAMES.get(kind, lambda name: name)
    # the family's own routers left float by the recipe (Llama 4's router is an nn.Linear subclass)
    floats = [re.compile(p[3:]) for p in IGNORE_MORE.get(kind, [])]
    weights = {rename(name) + ".weight": mod.weight.detach().to(torch.float16).contiguous()
               for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and ".layers." in name and not any(f.match(name) for f in floats)}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        packed = {n[: -len("_packed")] for n in f.keys() if n.endswith(".weight_packed")}
    if packed != set(weights):  # a module the runtime did not load from the checkpoint, or named otherwise
        raise SystemExit(f"{kind}: the runtime's Linears are not the checkpoint's quantized modules: "
                         f"{sorted(packed ^ set(weights))[:4]}")
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float().contiguous()
    return weights, {"logits": logits, "prompt": ids[0].contiguous()}


def in_venv_main(kind: str, base: Path, prompt: list) -> None:
    from safetensors.torch import save_file

    out = _common.PRODUCER_FIXTURES / FAMILIES[kind]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    produce(kind, base, out / "model")
    weights, logits = oracle(kind, out / "model", prompt)
    if kind in REFERENCE_ROWS:
        weights = {name: w[: REFERENCE_ROWS[kind]].contiguous() for name, w in weights.items()}
    save_file(weights, str(out / "reference.safetensors"))
    save_file(logits, str(out / "logits.safetensors"))
    built = f", layers {LAYERS[kind]}" if kind in LAYERS else ""
    built += ", deepseek_v4_dequantized: the release's names" if kind == "deepseek_v4" else ""
    _common.write_versions(out, "llmcompressor", list(PACKAGES),
                           base=f"tests/support/fixtures_archs.py {kind} (seed 0{built})", **WEIGHTS,
                           **WEIGHTS_MORE.get(kind, {}), **({"dtype": DTYPE[kind]} if kind in DTYPE else {}))
    print(out)


def main() -> int:
    ap = _common.parser(__doc__)
    ap.add_argument("families", nargs="*", metavar="FAMILY", help=f"of {', '.join(FAMILIES)} (default: all)")
    ap.add_argument("--in-venv", nargs=3, metavar=("FAMILY", "BASE", "PROMPT"), help=argparse_hidden())
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    _common.offline_defaults(HF_DATASETS_OFFLINE="1")
    if args.in_venv:
        kind, base, prompt = args.in_venv
        in_venv_main(kind, Path(base), [int(t) for t in prompt.split(",")])
        return 0
    _support()
    import fixtures_archs  # noqa: E402

    prompt = ",".join(map(str, fixtures_archs.arch_prompt()))
    py = _common.ensure_venv(VENV, PINS[0], list(PINS[1:]))
    failed = 0
    for kind in args.families or list(FAMILIES):
        with tempfile.TemporaryDirectory(prefix=f"qconvert-lc-{kind}-") as tmp:
            build_base(kind, Path(tmp) / "base")
            rc = _common.rerun(py, __file__, ["--in-venv", kind, str(Path(tmp) / "base"), prompt],
                               HF_DATASETS_OFFLINE="1")
            print(f"{kind}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}")
            failed += rc != 0
    return 1 if failed else 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
