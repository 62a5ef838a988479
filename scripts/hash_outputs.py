#!/usr/bin/env python
"""Hash the outputs of a fixed list of conversions, to show that a change of code moved no byte.

    python scripts/hash_outputs.py [--work DIR] [--json FILE] [--only NAME,...]

Every conversion runs as a user runs it (`python -m qconvert 'SRC->DST' SRC OUT ...`, a fresh process with
the interpreter running this script), on inputs that are either committed (examples/, the producer fixtures
of tests/producer_fixtures/) or made here from them (an FP8 checkpoint, a gpt-oss MXFP4 checkpoint) with a
seeded generator, or the output of an earlier conversion of the list (so every reader and every writer
takes part). Printed, one line per conversion:

    <name>  <sha256 of the output's files>  <sha256 of the report>  <exit status>

The first hash covers every output file's relative path and bytes; the second the report.json with its two
run-specific values (seconds, paths) removed: verdicts, reasons, targets and measured errors stay. Run it at
two commits and compare the lists (`diff`).

Only public interfaces are used (the CLI, safetensors, transformers for one input), so the same script
runs before and after a rework of the package's insides.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny-llama-gptq-4bit"
PF = REPO / "tests" / "producer_fixtures"

# (name, pair, source, output, extra arguments). A source written "@name" is the output of that conversion.
CONVERSIONS = [
    ("gptq-gguf", "gptq->gguf", str(EXAMPLE), "a.gguf", []),
    ("gptq-gguf-q4_k_m", "gptq->gguf", str(EXAMPLE), "b.gguf", ["--type", "q4_k_m", "--allow-requant"]),
    ("gptq-gptq_v2", "gptq->gptq-v2", str(EXAMPLE), "gptq-v2", []),
    ("gptq_v2-hqq", "gptq-v2->hqq", "@gptq-gptq_v2", "hqq", []),
    ("hqq-uqff", "hqq->uqff", "@gptq_v2-hqq", "uqff", []),
    ("uqff-hf", "uqff->hf", "@hqq-uqff", "hf-from-uqff", ["--type", "f32"]),
    ("gguf-hf", "gguf->hf", "@gptq-gguf", "hf", ["--type", "f32"]),
    ("gguf-uqff", "gguf->uqff", "@gptq-gguf", "uqff-from-gguf", []),
    ("gguf-gguf-iq4_xs", "gguf->gguf", "@gptq-gguf", "c.gguf", ["--type", "iq4_xs", "--allow-requant"]),
    ("hf-gguf-q4_k_m", "hf->gguf", "@gguf-hf", "d.gguf", ["--type", "q4_k_m", "--allow-requant"]),
    ("hf-mlx", "hf->mlx", "@gguf-hf", "mlx", ["--type", "4g64", "--allow-requant"]),
    ("hf-qqq", "hf->qqq", "@gguf-hf", "qqq", ["--type", "g128", "--allow-requant"]),
    ("qqq-gptq", "qqq->gptq", "@hf-qqq", "gptq-from-qqq", []),
    ("hf-hqq-qmodel", "hf->hqq", "@gguf-hf", "hqq-qmodel", ["--type", "qmodel:4g64", "--allow-requant"]),
    ("hf-compressed_tensors", "hf->compressed-tensors", "@gguf-hf", "ct-from-hf",
     ["--type", "4g128", "--allow-requant"]),
    ("mlx-gguf", "mlx->gguf", str(PF / "mlx" / "model"), "e.gguf", []),
    ("awq-compressed_tensors", "awq->compressed-tensors", str(PF / "awq" / "gemm_g128"), "ct-from-awq", []),
    ("awq_gemv-gguf", "awq->gguf", str(PF / "awq" / "autoawq_gemv"), "f.gguf", ["--allow-requant"]),
    ("compressed_tensors-gptq_v2", "compressed-tensors->gptq-v2", str(PF / "compressed_tensors" / "w4a16_g32_sym"),
     "gptq-v2-from-ct", []),
    ("compressed_tensors_nvfp4-gguf", "compressed-tensors->gguf", str(PF / "compressed_tensors" / "nvfp4a16"),
     "g.gguf", []),
    ("compressed_tensors_fp8_block-uqff", "compressed-tensors->uqff", str(PF / "compressed_tensors" / "fp8_block"),
     "uqff-from-ct", ["--allow-requant"]),
    ("auto_round-mlx", "auto-round->mlx", str(PF / "auto_round" / "sym4_g32"), "mlx-from-auto-round", []),
    ("auto_round_mixed-gguf", "auto-round->gguf", str(PF / "auto_round" / "mixed_asym"), "h.gguf",
     ["--allow-requant"]),
    ("bitsandbytes_nf4-gguf", "bitsandbytes->gguf", str(PF / "bitsandbytes" / "nf4_dq"), "i.gguf",
     ["--type", "q4_k", "--allow-requant"]),
    ("bitsandbytes_int8-hf", "bitsandbytes->hf", str(PF / "bitsandbytes" / "int8"), "hf-from-bnb", []),
    ("modelopt_nvfp4-gguf", "modelopt->gguf", str(PF / "modelopt" / "nvfp4"), "j.gguf", []),
    ("modelopt_mxfp4-uqff", "modelopt->uqff", str(PF / "modelopt" / "mxfp4"), "uqff-from-modelopt", []),
    ("modelopt_fp8-compressed_tensors", "modelopt->compressed-tensors", str(PF / "modelopt" / "fp8"),
     "ct-from-modelopt", []),
    ("fp8-gguf-q8_0", "fp8->gguf", "@made:fp8", "k.gguf", ["--type", "q8_0", "--allow-requant"]),
    ("fp8-hf", "fp8->hf", "@made:fp8", "hf-from-fp8", []),
    ("mxfp4-gguf", "mxfp4->gguf", "@made:gpt-oss-mxfp4", "l.gguf", []),
    ("gguf-gpt_oss-hf", "gguf->hf", "@mxfp4-gguf", "hf-from-gpt-oss", ["--type", "f32"]),
    ("gptq-gguf-split", "gptq->gguf", str(EXAMPLE), "m.gguf", ["--split-max-size", "200K"]),
]


# -- inputs made here ---------------------------------------------------------------------------------
def make_fp8(hf_dir: Path, out: Path) -> Path:
    """transformers' FineGrainedFP8 layout (DeepSeek-V3's): every decoder linear as float8_e4m3fn with a float32
    weight_scale_inv per 128x128 block (partial edge blocks), the rest bf16; from the dense f32 folder."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as st:
        for name in st.keys():
            w = st.get_tensor(name)
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                rows, cols = w.shape
                nr, nc = -(-rows // 128), -(-cols // 128)
                x = torch.zeros(nr * 128, nc * 128)
                x[:rows, :cols] = w.to(torch.bfloat16).float()
                tiles = x.view(nr, 128, nc, 128)
                amax = tiles.abs().amax(dim=(1, 3))
                scale = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, torch.ones_like(amax)),
                                    torch.ones_like(amax))
                q = torch.clamp(tiles * scale[:, None, :, None], -448.0, 448.0).to(torch.float8_e4m3fn)
                tensors[name] = q.view(nr * 128, nc * 128)[:rows, :cols].contiguous()
                tensors[name[: -len(".weight")] + ".weight_scale_inv"] = (1.0 / scale).to(torch.float32)
            else:
                tensors[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _copy_tokenizer(hf_dir, out)
    return out


_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def make_gpt_oss_mxfp4(out: Path) -> Path:
    """A two-layer gpt-oss (transformers' GptOssForCausalLM, seeded weights) saved as gpt-oss ships it: the
    experts' gate_up_proj / down_proj as MXFP4 `_blocks` / `_scales` [experts, out, in], the rest float32."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    dense = out.with_name(out.name + "-dense")
    cfg = GptOssConfig(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=None, head_dim=32,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rms_norm_eps=1e-5,
                       swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": True})
    cfg.dtype = torch.float32
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(t.shape, generator=gen) - 0.5)
            elif t.dim() >= 2:
                v = torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5
            else:
                v = 0.1 * torch.randn(t.shape, generator=gen)
            t.copy_(v)
    model.save_pretrained(str(dense), safe_serialization=True)
    out.mkdir(parents=True)
    saved = {}
    for name, t in load_file(str(dense / "model.safetensors")).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            w = t.transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
            e, rows, cols = w.shape
            x = w.reshape(e, rows, cols // 32, 32).float()
            exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(2.0 ** -120) / 6.0)).clamp(-127, 127)
            scaled = x / torch.exp2(exp)[..., None]
            mag = (scaled.abs()[..., None] - torch.tensor(_FP4)).abs().argmin(-1)
            codes = (mag | ((scaled < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8)
            saved[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
            saved[name + "_scales"] = (exp + 127).to(torch.uint8)
        else:
            saved[name] = t
    save_file(saved, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(EXAMPLE, out)
    shutil.rmtree(dense)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy2(src / name, out / name)


# -- hashing ------------------------------------------------------------------------------------------
def tree_digest(path: Path) -> str:
    """sha256 over every file below `path` (or `path` itself, or the split parts named after it): relative
    name and bytes, in name order."""
    h = hashlib.sha256()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        base = path
    else:
        files = sorted(p for p in path.parent.iterdir()
                       if p.is_file() and (p == path or p.name.startswith(path.stem + "-0")))
        base = path.parent
    for f in files:
        h.update(str(f.relative_to(base)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def report_digest(report: Path) -> str:
    if not report.exists():
        return "-"
    data = json.loads(report.read_text())
    data.get("summary", {}).pop("seconds", None)
    for side in ("source", "target"):
        data.get(side, {}).pop("path", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="folder for inputs and outputs (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, help="also write {name: {files, report, status, stderr}} here")
    ap.add_argument("--only", help="comma-separated conversion names (their @sources run too)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="qconvert-hashes-"))
    work.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only.split(",")) if args.only else None
    by_name = {c[0]: c for c in CONVERSIONS}
    if wanted:
        todo = set()
        stack = list(wanted)
        while stack:
            n = stack.pop()
            todo.add(n)
            src = by_name[n][2]
            if src.startswith("@") and not src.startswith("@made:"):
                stack.append(src[1:])
        wanted = todo
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONHASHSEED": "0"}
    made: dict[str, Path] = {}
    results = {}
    try:
        for name, pair, src, out_name, extra in CONVERSIONS:
            if wanted and name not in wanted:
                continue
            if src == "@made:fp8":
                if "fp8" not in made:
                    made["fp8"] = make_fp8(work / "gguf-hf" / "hf", work / "made-fp8")
                src_path = made["fp8"]
            elif src == "@made:gpt-oss-mxfp4":
                if "mxfp4" not in made:
                    made["mxfp4"] = make_gpt_oss_mxfp4(work / "made-gpt-oss-mxfp4")
                src_path = made["mxfp4"]
            elif src.startswith("@"):
                prev = by_name[src[1:]]
                src_path = work / prev[0] / prev[3]
            else:
                src_path = Path(src)
            out_dir = work / name
            if out_dir.exists():
                shutil.rmtree(out_dir)
            out_dir.mkdir()
            out = out_dir / out_name
            report = out_dir / "report.json"
            cmd = [sys.executable, "-m", "qconvert", pair, str(src_path), str(out), "--quiet", "--report",
                   str(report), *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work))
            written = out.exists() or any(p.name.startswith(out.stem + "-0") for p in out_dir.iterdir())
            files = tree_digest(out) if written else "-"
            rep = report_digest(report)
            results[name] = {"files": files, "report": rep, "status": proc.returncode,
                             "stderr": proc.stderr.strip().splitlines()[-1:] if proc.returncode else []}
            print(f"{name:36s} {files[:16]}  {rep[:16]}  {proc.returncode}", flush=True)
            if proc.returncode:
                print(f"    {proc.stderr.strip()[-400:]}", flush=True)
    finally:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["status"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
