"""Benchmark at the size that matters: synthetic full-width MoE layers of DeepSeek-V4 and Kimi-K3 shape,
converted by qconvert (1 and N workers) and by llama.cpp's route, then projected to the whole model.

The slice: `--layers` layers (default 1) of one shape, each full width (hidden 7168, MLA attention with a q LoRA
of 1536 and a kv LoRA of 512, nope 128 / rope 64 / v 128, one shared expert and the routed experts of width
2048) but with only `--experts` E routed experts (default 4) of the 256 (DeepSeek-V4-like, 128 heads) or 384
(Kimi-K3-like, 64 heads) a real layer has. Stored as each ships: attention and the shared expert FP8 e4m3 with
one scale per 128x128 block, the routed experts MXFP4 (E2M1 codes, one E8M0 exponent per 32), as a
compressed-tensors checkpoint with two config groups (float-quantized block + mxfp4-pack-quantized: Kimi-K3's
form, and DeepSeek-V4's tensors in it). qconvert does NOT write llama.cpp's `kimi-k3` arch (gguf 0.19
lacks it) and writes `deepseek4` only from DeepSeek-V4's release layout (formats/hf/deepseek_v4.py), so the layers are laid out as DeepSeek-V3 (`DeepseekV3ForCausalLM`, llama.cpp arch
`deepseek2`: the same widths; Kimi-K2 is this arch too). A tiny vocabulary keeps the embeddings out of the
figures.

Conversions, every one a fresh process timed with its peak RSS (GNU time's %M; a worker's is its own VmHWM,
sampled from /proc every 0.1 s):
  (a) mxfp4   the experts -> GGUF MXFP4 (a byte move), attention as qconvert's default for FP8 blocks; next to
              `cat` of the source files into one file (the disk bound of moving those bytes)
  (b) q4_k_m  everything requantized to llama-quantize's Q4_K_M mix
  (c) iq2_xxs with a synthetic importance matrix (legacy .dat, formats/gguf/imatrix.py reads it; values in
              [0.5, 1.5), one per input column, and per slice of a 3-D tensor: experts, MLA heads) for every
              weight of the GGUF (scripts/llama_quantize_route.py), the same file for both sides
each at `--workers 1` and `--workers N` (N = --workers, default 2), and by llama.cpp's route at N threads:
llama.cpp's converter (convert_hf_to_gguf.py, scripts/llama_cpp_reference.py) cannot read this source (it raises
"Can't handle multiple config groups for compressed-tensors yet"), so its route starts from a bf16 copy made by
`qconvert ct->hf --type bf16` (timed, step 0), then the converter to a bf16 GGUF (step 1, once, shared by the
targets), then llama-quantize (`llama_model_quantize`, step 2) with the same imatrix for IQ2_XXS. The route's
seconds are the sum of its steps, its peak the largest.

Projections (stated as such): seconds per layer = measured seconds x (a full layer's weights / the slice's
weights), i.e. linear in the weights converted, which holds for requantizing (every tensor costs per element)
and for byte moves (per byte); whole model = layers x that + the header. Nothing is asserted on the timings.

    nice -n 10 python scripts/bench_giant.py [--shape v4|k3] [--experts 4] [--layers 1] [--workers 2]
        [--cases mxfp4,q4_k_m,iq2_xxs] [--no-route] [--work DIR] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_cpp_reference import reference_command  # noqa: E402
from llama_quantize_route import QUANTIZE_SCRIPT, ftype, write_synthetic_imatrix  # noqa: E402

MB = 1_000_000
HIDDEN, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, MOE_FFN = 7168, 1536, 512, 128, 64, 128, 2048
SHAPES = {  # routed experts, heads, layers of the released model (DeepSeek-V3 / Kimi-K2 layout: 61)
    "v4": dict(label="DeepSeek-V4-like", experts=256, heads=128, model_layers=61),
    "k3": dict(label="Kimi-K3-like", experts=384, heads=64, model_layers=61),
}
VOCAB = 1024
FTYPES = {"q4_k_m": "Q4_K_M", "iq2_xxs": "IQ2_XXS", "mxfp4": "MXFP4_MOE"}


# ---- the synthetic source ------------------------------------------------------------------------------
def layer_tensors(layer: int, heads: int, experts: int) -> list[tuple[str, tuple[int, int], str]]:
    """(name, [out, in], kind) of one MoE layer: kind fp8 / mxfp4 / dense."""
    p = f"model.layers.{layer}."
    t = [(p + "self_attn.q_a_proj", (Q_LORA, HIDDEN), "fp8"),
         (p + "self_attn.q_b_proj", (heads * (NOPE + ROPE), Q_LORA), "fp8"),
         (p + "self_attn.kv_a_proj_with_mqa", (KV_LORA + ROPE, HIDDEN), "fp8"),
         (p + "self_attn.kv_b_proj", (heads * (NOPE + V_DIM), KV_LORA), "fp8"),
         (p + "self_attn.o_proj", (HIDDEN, heads * V_DIM), "fp8")]
    for head, kind in [(f"mlp.experts.{e}.", "mxfp4") for e in range(experts)] + [("mlp.shared_experts.", "fp8")]:
        t += [(p + head + "gate_proj", (MOE_FFN, HIDDEN), kind), (p + head + "up_proj", (MOE_FFN, HIDDEN), kind),
              (p + head + "down_proj", (HIDDEN, MOE_FFN), kind)]
    return t


def weights_of_layer(heads: int, experts: int) -> int:
    return sum(o * i for _, (o, i), _ in layer_tensors(0, heads, experts))


def _fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """e4m3 codes with one float32 scale per 128x128 block, the edge blocks partial (ceil-divided, as DeepSeek's
    kv_a_proj_with_mqa of 576 rows ships)."""
    out_f, in_f = w.shape
    bo, bi = -(-out_f // 128), -(-in_f // 128)
    padded = torch.zeros(bo * 128, bi * 128)
    padded[:out_f, :in_f] = w
    s = padded.reshape(bo, 128, bi, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (padded.reshape(bo, 128, bi, 128) / s[:, None, :, None]).reshape(bo * 128, bi * 128)[:out_f, :in_f]
    return {"weight": q.contiguous().to(torch.float8_e4m3fn), "weight_scale": s.to(torch.float32)}


def _mxfp4(gen: torch.Generator, out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    # random codes (any byte is two valid E2M1 codes) and exponents near 2**-8 (a |w| ~ 0.01-0.1)
    packed = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(117, 122, (out_f, in_f // 32), dtype=torch.uint8, generator=gen)
    return {"weight_packed": packed, "weight_scale": scale}


def make_source(out: Path, shape: str, experts: int, layers: int, seed: int = 0) -> Path:
    """The compressed-tensors checkpoint, one safetensors shard per layer (at most a layer in memory)."""
    spec = SHAPES[shape]
    heads = spec["heads"]
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}

    def save(tensors: dict, name: str):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    save({"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16),
          "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
          "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)},
         "model-00000.safetensors")
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shard = {p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                 p + "self_attn.q_a_layernorm.weight": torch.ones(Q_LORA, dtype=torch.bfloat16),
                 p + "self_attn.kv_a_layernorm.weight": torch.ones(KV_LORA, dtype=torch.bfloat16),
                 p + "mlp.gate.weight": (torch.randn(experts, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16),
                 p + "mlp.gate.e_score_correction_bias": torch.zeros(experts, dtype=torch.float32)}
        for name, (o, i), kind in layer_tensors(layer, heads, experts):
            if kind == "fp8":
                w = torch.randn(o, i, generator=gen) / float(i) ** 0.5
                parts = _fp8_block(w)
            else:
                parts = _mxfp4(gen, o, i)
            shard.update({f"{name}.{k}": v for k, v in parts.items()})
        save(shard, f"model-{layer + 1:05d}.safetensors")
        del shard
    weights = {"strategy": "block", "block_structure": [128, 128], "num_bits": 8, "type": "float", "symmetric": True,
               "dynamic": False, "group_size": None, "actorder": None, "observer": "memoryless_minmax",
               "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}
    mx = {"strategy": "group", "group_size": 32, "num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
          "block_structure": None, "actorder": None, "observer": "memoryless_minmax", "observer_kwargs": {},
          "scale_dtype": "torch.uint8", "zp_dtype": None}
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
          "version": "0.19.0", "ignore": ["lm_head", "re:.*mlp\\.gate$"], "kv_cache_scheme": None,
          "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
          "config_groups": {
              "group_0": {"format": "float-quantized", "targets": ["re:.*self_attn\\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$",
                                                                  "re:.*shared_experts\\..*_proj$"],
                          "weights": weights, "input_activations": None, "output_activations": None},
              "group_1": {"format": "mxfp4-pack-quantized", "targets": ["re:.*mlp\\.experts\\.\\d+\\..*_proj$"],
                          "weights": mx, "input_activations": None, "output_activations": None}}}
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": HIDDEN,
           "intermediate_size": 18432, "moe_intermediate_size": MOE_FFN, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": experts,
           "num_experts_per_tok": min(8, experts), "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
           "first_k_dense_replace": 0, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": Q_LORA,
           "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM,
           "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_interleave": True,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "bfloat16",
           "quantization_config": qc}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _tokenizer(out)
    return out


def _tokenizer(out: Path) -> None:
    """A byte-level BPE of VOCAB tokens trained in code (llama.cpp's converter needs a tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 50, "hello world 0123456789"] * 20,
                            trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))


# ---- timing ---------------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return out
    for c in kids:
        out += [c, *_children(c)]
    return out


def _hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        return None
    return None


def run_timed(cmd: list[str], env: dict) -> dict:
    """Wall seconds, the peak RSS of the command (GNU time %M) and the largest VmHWM among its descendants
    (the split's workers; a forked worker's mark includes pages it shares with the driver)."""
    fd, rss_file = tempfile.mkstemp(prefix="bench-giant-rss-")
    os.close(fd)
    t0 = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", rss_file, *cmd], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child_peak = 0.0
    out = b""
    os.set_blocking(proc.stdout.fileno(), False)
    while proc.poll() is None:
        for c in _children(proc.pid)[1:]:  # [0] is the command under time; the rest its workers
            child_peak = max(child_peak, _hwm_mb(c) or 0.0)
        out += proc.stdout.read() or b""
        time.sleep(0.1)
    out += proc.stdout.read() or b""
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        # recorded, not raised: the other runs of the table still count
        text = out.decode(errors="replace")
        why = [ln for ln in text.splitlines() if "error" in ln.lower() or "ASSERT" in ln][-3:] or text.splitlines()[-3:]
        print(f"FAILED ({proc.returncode}): {' '.join(map(str, cmd))[:200]}: {' | '.join(why)}", flush=True)
        return {"error": f"exit {proc.returncode}: {' | '.join(why)[:500]}", "seconds": float("nan"),
                "peak_mb": float("nan"), "worker_peak_mb": None}
    peak = [int(x) for x in Path(rss_file).read_text().split() if x.isdigit()]
    os.unlink(rss_file)
    return {"seconds": round(seconds, 2), "peak_mb": round(peak[-1] * 1024 / MB, 1) if peak else None,
            "worker_peak_mb": round(child_peak, 1) or None}


def qconvert(src: Path, out: Path, case: str, workers: int, imatrix: Path | None, env: dict,
             part_size: str, iq_quantizer: str = "qconvert") -> dict:
    cmd = [sys.executable, "-m", "qconvert", "ct->gguf", str(src), str(out), "--quiet", "--force",
           "--workers", str(workers), "--part-size", part_size]
    # --allow-requant: the FP8 attention becomes Q8_0 in (a), as llama-quantize's MXFP4_MOE makes it
    cmd += ["--allow-requant"] + (["--type", case] if case != "mxfp4" else [])
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    if case.startswith("iq") and iq_quantizer != "qconvert":
        cmd += ["--quantizer", iq_quantizer]
    return run_timed(cmd, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v4")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cases", default="mxfp4,q4_k_m,iq2_xxs")
    ap.add_argument("--part-size", default="256M", help="--part-size of the qconvert runs")
    ap.add_argument("--iq-quantizer", choices=["qconvert", "llama.cpp"], default="qconvert",
                    help="qconvert's --quantizer for the IQ cases (its own IQ2_XXS kernel is ~0.2x ggml's until "
                         "issue 29 item 2 lands: at this size llama.cpp's keeps a run in minutes)")
    ap.add_argument("--no-route", action="store_true", help="skip llama.cpp's route")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconvert-bench-giant"))
    ap.add_argument("--keep", action="store_true", help="keep the synthetic files (default: delete them)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    spec = SHAPES[args.shape]
    cases = args.cases.split(",")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)
    threads = {w: {**env, "QCONVERT_THREADS": str(max(1, (os.cpu_count() or 1) // w)),
                   "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // w))} for w in (1, args.workers)}
    result: dict = {"shape": spec["label"], "iq_quantizer": args.iq_quantizer, "experts": args.experts, "layers": args.layers, "cpus": os.cpu_count(),
                    "loadavg_before": os.getloadavg(), "runs": {}}
    try:
        src = work / f"src-{args.shape}-e{args.experts}-l{args.layers}"
        if not (src / ".done").exists():
            shutil.rmtree(src, ignore_errors=True)
            t0 = time.perf_counter()
            make_source(src, args.shape, args.experts, args.layers)
            (src / ".done").write_text("ok")
            print(f"source made in {time.perf_counter() - t0:.1f} s", flush=True)
        src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        slice_weights = args.layers * weights_of_layer(spec["heads"], args.experts)
        full_layer = weights_of_layer(spec["heads"], spec["experts"])
        result.update(source_mb=round(src_bytes / MB, 1), slice_weights=slice_weights, full_layer_weights=full_layer)
        print(f"{spec['label']}: {args.layers} layer(s) x {args.experts} experts: {slice_weights / 1e9:.3f} G weights "
              f"({src_bytes / MB:.0f} MB on disk); a full layer: {full_layer / 1e9:.2f} G", flush=True)

        # the disk bound: cat of the source's bytes into one file
        t0 = time.perf_counter()
        subprocess.run(f"cat {src}/*.safetensors > {work}/cat.bin && sync {work}/cat.bin", shell=True, check=True)
        result["cat_seconds"] = round(time.perf_counter() - t0, 2)
        (work / "cat.bin").unlink()

        imatrix = None
        bf16_gguf = None
        for case in cases:
            for w in (1, args.workers):
                out = work / f"qc-{case}-w{w}.gguf"
                if case == "iq2_xxs" and imatrix is None:
                    imatrix = work / "synthetic.imatrix.dat"
                    probe = work / "qc-mxfp4-w1.gguf"
                    if not probe.exists():
                        qconvert(src, probe, "mxfp4", 1, None, threads[1], args.part_size)
                    print(f"imatrix: {write_synthetic_imatrix(probe, imatrix)} entries", flush=True)
                r = qconvert(src, out, case, w, imatrix if case == "iq2_xxs" else None, threads[w], args.part_size,
                             args.iq_quantizer)
                r["out_mb"] = round(out.stat().st_size / MB, 1) if out.exists() else None
                result["runs"][f"qconvert {case} --workers {w}"] = r
                print(f"qconvert {case} --workers {w}: {r}", flush=True)
            if args.no_route:
                continue
            if bf16_gguf is None:
                hf = work / "route-bf16-hf"
                step0 = run_timed([sys.executable, "-m", "qconvert", "ct->hf", str(src), str(hf), "--type", "bf16",
                                   "--quiet", "--force"], threads[1])
                bf16_gguf = work / "route-bf16.gguf"
                step1 = run_timed(reference_command(hf, bf16_gguf, outtype="bf16"), threads[1])
                shutil.rmtree(hf)
                result["runs"]["route step0 qconvert ct->hf bf16"] = step0
                result["runs"]["route step1 convert_hf_to_gguf bf16"] = step1
                print(f"route steps 0/1: {step0} {step1}", flush=True)
            out = work / f"route-{case}.gguf"
            cmd = [sys.executable, "-c", QUANTIZE_SCRIPT, str(bf16_gguf), str(out), str(ftype(FTYPES[case])),
                   str(args.workers)]
            if case == "iq2_xxs":
                cmd.append(str(imatrix))
            r = run_timed(cmd, threads[1])
            r["out_mb"] = round(out.stat().st_size / MB, 1) if out.exists() else None
            result["runs"][f"route llama-quantize {case} {args.workers} threads"] = r
            print(f"route llama-quantize {case}: {r}", flush=True)
        result["loadavg_after"] = os.getloadavg()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(result, cases, args.workers, spec)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def report(result: dict, cases: list[str], n: int, spec: dict) -> None:
    runs = result["runs"]
    scale = result["full_layer_weights"] / result["slice_weights"]
    layers = spec["model_layers"]
    route0 = sum(runs[k]["seconds"] for k in runs if k.startswith("route step"))
    route0_peak = max([runs[k]["peak_mb"] for k in runs if k.startswith("route step")] or [0])
    print(f"\n{spec['label']} slice: {result['layers']} layer(s), {result['experts']} experts; cat of the source "
          f"{result['cat_seconds']} s; projection factor to a full layer {scale:.1f}x, to the model x{layers}")
    print(f"| case | qconvert w1 s | w{n} s | peak MB w1 / w{n} (worker) | route s (bf16 steps + quantize) | route peak "
          f"MB | route / w{n} | projected s per full layer w{n} | projected model h w{n} |")
    for case in cases:
        a, b = runs[f"qconvert {case} --workers 1"], runs[f"qconvert {case} --workers {n}"]
        q = runs.get(f"route llama-quantize {case} {n} threads")
        rs = f"{route0 + q['seconds']:.1f} ({route0:.1f} + {q['seconds']:.1f})" if q else "-"
        rp = f"{max(route0_peak, q['peak_mb']):.0f}" if q else "-"
        ratio = f"{(route0 + q['seconds']) / b['seconds']:.2f}x" if q else "-"
        per_layer = b["seconds"] * scale
        print(f"| {case} | {a['seconds']:.1f} | {b['seconds']:.1f} | {a['peak_mb']:.0f} / {b['peak_mb']:.0f} "
              f"({b['worker_peak_mb'] or 0:.0f}) | {rs} | {rp} | {ratio} | {per_layer:.0f} | "
              f"{per_layer * layers / 3600:.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
