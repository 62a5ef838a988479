"""Offline MoE fixtures: tiny random Qwen3-MoE (and Mixtral) models and real GPTQ checkpoints made from
them by gptqmodel 7.6.0 on CPU, plus gptqmodel's own dequantization as the reference.

Layout under ``root`` (default ``tests/_fixtures/moe``, its own lock so that building it never waits on
the dense GPTQ fixtures)::

    root/
      base_<kind>/                fp16 Qwen3MoeForCausalLM / MixtralForCausalLM + tokenizer
      <kind>_b<bits>_g<group>_<sym|asym>/
        ckpt/                     the gptqmodel checkpoint (quant_log.csv removed)
        coverage.json             per quantized module: how gptqmodel quantized it (from quant_log.csv)
        .done                     marker (the kwargs as JSON)

The tiny model (both kinds): vocab 512 (tests/support/fixtures.py build_tokenizer), hidden 128, 2 layers, 4 heads
of 32, 2 KV heads, 4 experts, top-2, expert FFN 128 (so every linear's in-features is a multiple of 128).

What transformers 5.24 and gptqmodel 7.6 do with the experts (found by reading and running them):
* transformers 5.24 fuses the experts at load time into 3-D parameters (``mlp.experts.gate_up_proj``
  [E, 2*I, H] and ``mlp.experts.down_proj`` [E, H, I]) and un-fuses them again when saving, so
  ``save_pretrained`` writes per-expert 2-D weights: Qwen3-MoE ``mlp.experts.N.{gate,up,down}_proj.weight``,
  Mixtral its legacy names ``block_sparse_moe.experts.N.{w1,w3,w2}.weight``.
* gptqmodel 7.6 loads MoE models through its ``defuser`` package, which swaps in a sparse-MoE block with
  one ``nn.Linear`` per expert (defuser/modeling/unfused_moe/qwen3_moe.py, mixtral.py); the quantized and
  the re-loaded model both keep per-expert modules, and the checkpoint holds per-expert
  ``qweight/qzeros/scales/g_idx``. For Mixtral the defuser's checkpoint mapping renames
  ``block_sparse_moe`` -> ``mlp`` and w1/w3/w2 -> gate/up/down_proj, so gptqmodel SAVES Mixtral under the
  Qwen-style names ``mlp.experts.N.gate_proj`` (not the names of the fp16 base).
* the router ``mlp.gate`` (``"gate:!"`` in the model definitions' module_tree) is never quantized; it is
  saved dense, in the load dtype (fp16 here), as are norms, embeddings and lm_head.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

sys.path.insert(0, str(Path(__file__).parent))
import fixtures  # noqa: E402  (sets the gptqmodel environment variables, GPTQMODEL_CPU_WORKERS=2)

DEFAULT_ROOT = fixtures.DEFAULT_ROOT / "moe"
KINDS = ("qwen3_moe", "mixtral")
BASE_SEED = 4242
NUM_EXPERTS = 4
TOP_K = 2
EXPERT_FFN = 128


# --------------------------------------------------------------------------------------------------
# Tiny MoE model
# --------------------------------------------------------------------------------------------------
def _moe_config(kind: str):
    import torch

    common = dict(
        vocab_size=fixtures.VOCAB_SIZE, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=None,
        num_experts_per_tok=TOP_K, dtype=torch.float16,
    )
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        # intermediate_size sizes only the dense MLP of `mlp_only_layers` (none here): every layer is MoE
        return Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=EXPERT_FFN, num_experts=NUM_EXPERTS,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              attention_bias=False, use_sliding_window=False, **common), Qwen3MoeForCausalLM
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralConfig(intermediate_size=EXPERT_FFN, num_local_experts=NUM_EXPERTS, **common), MixtralForCausalLM
    raise ValueError(f"unknown MoE kind {kind!r}; known: {KINDS}")


def _fan_in_std(shape: tuple) -> float:
    """1/sqrt(fan_in): the last dimension is the input of every linear, fused 3-D experts included
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and of the router [E, H]."""
    return shape[-1] ** -0.5


def _defuser_patched() -> bool:
    """True once gptqmodel has loaded an MoE model in this process: its loader calls
    ``defuser.replace_fused_blocks(model_type)``, which replaces transformers' sparse-MoE block classes
    (Qwen3MoeSparseMoeBlock -> per-expert nn.Linear) and transformers' global
    ``get_checkpoint_conversion_mapping`` (keeping the original as
    ``conversion_mapping.orig_get_checkpoint_conversion_mapping``). After that a freshly built Qwen3-MoE
    draws its random weights in other shapes, and Mixtral's save_pretrained writes the fused 3-D
    ``block_sparse_moe.experts.gate_up_proj`` instead of per-expert w1/w2/w3 (seen with 7.6.0 / 5.24)."""
    import transformers.conversion_mapping as conversion_mapping
    return hasattr(conversion_mapping, "orig_get_checkpoint_conversion_mapping")


def build_tiny_moe(out_dir, kind: str = "qwen3_moe", seed: int = BASE_SEED) -> Path:
    """Random tiny MoE causal LM saved in fp16 safetensors with the tokenizer into ``out_dir``.

    Linear weights (experts, router, attention, lm_head) ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm
    weights 1 +- 0.1 (uniform): the logits are O(1) and far from uniform.

    Refuses to run in a process where gptqmodel has loaded an MoE model (see _defuser_patched);
    :func:`ensure_moe_base` therefore builds in a fresh interpreter."""
    import torch

    if _defuser_patched():
        raise RuntimeError("transformers is patched by gptqmodel's defuser in this process (an MoE model was "
                           "loaded with gptqmodel): build the base in a fresh process (ensure_moe_base does)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, cls = _moe_config(kind)
    torch.manual_seed(seed)
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(shape, generator=gen, dtype=torch.float32) - 0.5)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen, dtype=torch.float32)
            elif len(shape) in (2, 3):
                v = torch.randn(shape, generator=gen, dtype=torch.float32) * _fan_in_std(shape)
            else:
                raise RuntimeError(f"unexpected parameter {name} {shape}")
            p.copy_(v.to(p.dtype))
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    if model.generation_config is not None:
        model.generation_config.bos_token_id = 1
        model.generation_config.eos_token_id = 0
    model.save_pretrained(str(out), safe_serialization=True)
    fixtures.build_tokenizer(out)
    return out


# --------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------
def _read_quant_log(ckpt: Path) -> Dict[str, dict]:
    """gptqmodel's quant_log.csv (one row per quantized module) -> {module: row}. Read before the file
    is removed: its `loss` column says "rtn fallback" / "fallback(rtn): ..." for a module that was
    round-to-nearest quantized because too few calibration tokens reached it."""
    path = ckpt / "quant_log.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for row in rows:
        layer, module = row.get("layer", ""), row.get("module", "")
        out[f"model.layers.{layer}.{module}" if layer.isdigit() else module] = row
    return out


def _coverage(log_rows: Dict[str, dict]) -> Dict[str, dict]:
    return {name: {"samples": row.get("samples"), "loss": row.get("loss"),
                   "fallback": "fallback" in str(row.get("loss", "")).lower()}
            for name, row in sorted(log_rows.items())}


def quantize_moe_gptq(base_dir, out_dir, bits: int = 4, group_size: int = 32, sym: bool = True,
                      fmt: str = "gptq") -> tuple[Path, Dict[str, dict]]:
    """Quantize an MoE base with gptqmodel 7.6 on CPU; returns (checkpoint dir, per-module coverage).

    Every expert is GPTQ-quantized from calibration data: ``moe=MoEConfig(routing=ExpertsRoutingBypass())``
    forwards the whole calibration set through every expert while quantizing (its lifecycle hooks,
    models/moe_lifecycle.py), instead of only the tokens the router picks. Without it gptqmodel's default
    ``Fallback(strategy=RTN, threshold="0.5%")`` (quantization/config.py) would round-to-nearest any
    module that saw fewer than 0.5% of the calibration tokens, silently (a log line and a "fallback"
    loss in quant_log.csv). ``ExpertsRoutingOverride(num_experts_per_tok="all")`` is the other
    option (top-k raised to E for the calibration forwards)."""
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import ExpertsRoutingBypass, MoEConfig

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    qcfg = QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=False, format=fmt,
                          offload_to_disk=False, moe=MoEConfig(routing=ExpertsRoutingBypass()))
    fixtures._seed_all()
    model = GPTQModel.load(str(base_dir), qcfg, device="cpu", dtype=torch.float16)
    model.quantize(fixtures.calibration_data(), batch_size=1)
    model.save(str(out))
    del model
    coverage = _coverage(_read_quant_log(out))
    fixtures._clean_checkpoint(out)
    return out, coverage


def _variant_name(kind: str, bits: int, group_size: int, sym: bool) -> str:
    return f"{kind}_b{bits}_g{group_size if group_size > 0 else 'm1'}_{'sym' if sym else 'asym'}"


def ensure_moe_base(root, kind: str) -> Path:
    root = Path(root)
    d = root / f"base_{kind}"
    if not fixtures._done(d):
        if d.exists():
            shutil.rmtree(d)
        # a fresh interpreter: this one may hold transformers classes patched by gptqmodel (_defuser_patched)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-base", str(d), "--kind", kind],
                       check=True)
        fixtures._mark_done(d, {"kind": "base", "arch": kind, "seed": BASE_SEED})
    return d


_BUILDER = "QCONVERT_MOE_FIXTURE_BUILDER"  # set in the child process that quantizes


def ensure_moe_gptq(root=DEFAULT_ROOT, kind: str = "qwen3_moe", bits: int = 4, group_size: int = 32,
                    sym: bool = True, verbose: bool = False) -> Path:
    """Path of a gptqmodel-quantized MoE checkpoint (built once, cached with a ``.done`` marker).

    Findings (gptqmodel 7.6.0, transformers 5.24, CPU, GPTQMODEL_CPU_WORKERS=2):
    * experts without routed tokens: gptqmodel's default ``fallback`` is RTN for any module that saw fewer
      than 0.5% of the calibration tokens (quantization/gptq.py: should_use_fallback before the Hessian
      is used). To get real GPTQ for every expert this fixture passes
      ``moe=MoEConfig(routing=ExpertsRoutingBypass())`` (all calibration tokens through every expert);
      ``coverage.json`` records, from quant_log.csv, that every expert linear was quantized and that none
      fell back to RTN (ensure_moe_gptq raises otherwise). Measured on this tiny model: with native top-2
      routing and the 32 x 64 calibration set every expert gets 868..1162 of 2048 tokens (no fallback);
      with a calibration set of one repeated token two experts per layer get 0 tokens and are RTN'd
      (quant_log loss "fallback(rtn): ..."); with ``fallback=None`` those experts are NOT quantized at all:
      they are saved as dense fp16 ``...experts.E.gate_proj.weight`` and excluded in quantization_config
      ``dynamic`` by unanchored ``"-:model\\.layers\\.0\\.mlp\\.experts\\.0\\.gate_proj": {}`` rules.
    * gptqmodel keeps per-expert ``nn.Linear`` modules (via the defuser) and saves per-expert GPTQ tensors
      ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.{qweight,qzeros,scales,g_idx}`` (for Mixtral too:
      renamed from block_sparse_moe.experts.E.w1/w3/w2); the router ``model.layers.L.mlp.gate.weight``
      [E, hidden] stays dense fp16.
    * the saved config.json holds ``num_local_experts`` (transformers 5.24's Qwen3MoeConfig maps
      num_experts onto it) and gptqmodel sets ``pad_token_id`` 0 (the base has null).
    * quantizing takes ~8 s per kind on 2 CPU cores (plus ~5 s for the base in a subprocess).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = _variant_name(kind, bits, group_size, sym)
    if not fixtures._done(root / name) and os.environ.get(_BUILDER) != "1":
        # quantize in a fresh interpreter: loading a MoE with gptqmodel patches transformers for the rest of
        # the process (models built afterwards differ, Mixtral saves fused experts), which would change every
        # later test in a pytest run that built the fixture
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--kind", kind,
                        "--bits", str(bits), "--group-size", str(group_size)] + ([] if sym else ["--asym"]),
                       check=True, env={**os.environ, _BUILDER: "1"})
        if not fixtures._done(root / name):
            raise RuntimeError(f"the fixture builder exited without building {root / name}")
        return root / name / "ckpt"
    with fixtures._RootLock(root):
        vdir = root / name
        ckpt = vdir / "ckpt"
        if fixtures._done(vdir):
            if verbose:
                print(f"cached {name}", flush=True)
            return ckpt
        base = ensure_moe_base(root, kind)
        t0 = time.perf_counter()
        if vdir.exists():
            shutil.rmtree(vdir)
        vdir.mkdir(parents=True)
        _, coverage = quantize_moe_gptq(base, ckpt, bits=bits, group_size=group_size, sym=sym)
        seconds = time.perf_counter() - t0
        _check_coverage(kind, coverage)
        (vdir / "coverage.json").write_text(json.dumps(coverage, indent=2, sort_keys=True) + "\n")
        fixtures._mark_done(vdir, {"kind": kind, "bits": bits, "group_size": group_size, "sym": sym,
                                   "fmt": "gptq", "moe_routing": "ExpertsRoutingBypass"})
        if verbose:
            print(f"built {name} in {seconds:.1f}s", flush=True)
        return ckpt


def expert_module_names(num_layers: int = 2, num_experts: int = NUM_EXPERTS):
    """The per-expert linears gptqmodel quantizes and saves (both kinds use these names)."""
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            for layer in range(num_layers) for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]


def _check_coverage(kind: str, coverage: Dict[str, dict]) -> None:
    missing = [m for m in expert_module_names() if m not in coverage]
    fell_back = [m for m, c in coverage.items() if c["fallback"]]
    if missing or fell_back:
        raise RuntimeError(f"{kind}: experts not GPTQ-quantized: missing {missing}, RTN fallback {fell_back}")


# --------------------------------------------------------------------------------------------------
# Reference: gptqmodel's own dequantization
# --------------------------------------------------------------------------------------------------
def moe_gptq_reference_in_child(ckpt_dir, dest) -> Dict[str, "object"]:
    """:func:`moe_gptq_reference` computed in a child process and saved to ``dest`` (a torch file): loading a
    MoE with gptqmodel patches transformers for the rest of the process, so a test process never does it."""
    import torch

    code = ("import sys, torch; sys.path.insert(0, sys.argv[3]); import fixtures_moe; "
            "torch.save(fixtures_moe.moe_gptq_reference(sys.argv[1]), sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt_dir), str(dest), str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"gptqmodel's dequantization failed:\n{proc.stderr[-3000:]}")
    return torch.load(dest)


def moe_gptq_reference(ckpt_dir) -> Dict[str, "object"]:
    """{HF weight name: float32 [out, in]} for every quantized linear of ``ckpt_dir``, from gptqmodel's
    own dequantization: the checkpoint loaded with ``BACKEND.GPTQ_TORCH`` on CPU in fp16 (as
    tests/support/fixtures.py _load_quantized), then each TorchLinear's ``dequantize_weight()`` ([in, out],
    transposed here). Keys like ``model.layers.0.mlp.experts.3.gate_proj.weight``: the loaded model keeps
    one quant module per expert, named as in the checkpoint."""
    import torch
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    m = fixtures._load_quantized(ckpt_dir)
    out = {}
    with torch.inference_mode():
        for name, mod in m.model.named_modules():
            if isinstance(mod, BaseQuantLinear):
                w = mod.dequantize_weight()
                if tuple(w.shape) != (mod.in_features, mod.out_features):
                    raise RuntimeError(f"{name}: unexpected dequantized shape {tuple(w.shape)}")
                out[f"{name}.weight"] = w.t().contiguous().to(torch.float32).cpu()
    if not out:
        raise RuntimeError(f"no quantized linears found in {ckpt_dir}")
    del m
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="Build the MoE GPTQ fixtures (tiny Qwen3-MoE / Mixtral).")
    ap.add_argument("--root", default=str(DEFAULT_ROOT))
    ap.add_argument("--kind", nargs="+", default=["qwen3_moe"], choices=KINDS)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--asym", action="store_true", help="asymmetric grids (default symmetric)")
    ap.add_argument("--build-base", metavar="DIR", help="only write the fp16 base of the (first) --kind to DIR")
    args = ap.parse_args(argv)
    if args.build_base:
        build_tiny_moe(args.build_base, kind=args.kind[0], seed=BASE_SEED)
        return 0
    for kind in args.kind:
        print(ensure_moe_gptq(args.root, kind=kind, bits=args.bits, group_size=args.group_size, sym=not args.asym,
                              verbose=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
