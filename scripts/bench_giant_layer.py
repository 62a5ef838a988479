#!/usr/bin/env python3
"""One giant MoE layer's MXFP4 experts into GGUF MXFP4, streamed, byte for byte (issue 26, item 3).

Builds a synthetic one-layer checkpoint whose routed experts have DeepSeek-V4 / Kimi-K3's full width
(hidden 7168, expert width 2048, 256 experts by default; --experts 384 for Kimi's count) stored as
compressed-tensors `mxfp4-pack-quantized` (what Kimi-K3 ships: per expert and projection a uint8
`weight_packed` [rows, cols/2], element 2i in the low nibble, and a uint8 E8M0 `weight_scale` [rows, cols/32];
DeepSeek-V4's native experts are the same bytes under other names), random codes and exponents, the rest of
the model tiny and dense (a DeepseekV3ForCausalLM config, llama.cpp's deepseek2: the stacks `blk.0.ffn_*_exps`
are the same tensors a deepseek4 / kimi-k3 file holds). Then, in a child process:

    qconvert ct->gguf SRC OUT --type mxfp4

timed, with its peak RSS (ru_maxrss of the child), against the same conversion of a 4-expert, 256-wide copy
(the baseline: interpreter, torch, the CLI), and what the growth is made of. Every expert of every stack in the output is then compared, one
expert at a time, with llama.cpp's own repack of the source's bytes (`ModelBase.repack_mxfp4_blocks` of the
llama-cpp-python sdist's conversion/base.py, which its kimi_k3 and deepseek4 converters call): equal bytes or
the script fails. What it shows: the codes and exponents are moved, never decoded and re-encoded, and the
codes stream (the writer spills each stack to a temporary file beside the output until its last expert
arrives), and so do the per-group parameters: a record reads its E8M0 scales when planned and drops them
(read again with the codes), the float grid's unused zero points are a stride-0 view, and the runner fixes
glibc's mmap threshold so that each tensor's freed temporaries go back to the system; the peak RSS grows by a
few expert tensors' work, not with the layer (measured: see docs/proofs.md; before, every grid's scales and
zero points, 2 bytes per 32 weights, were held from planning to writing, and the heap kept hundreds of MB of
freed temporaries).

    python scripts/bench_giant_layer.py [--experts 256] [--work /tmp/qconvert-giant-layer] [--keep]

Needs about 3.2x the layer's expert bytes of free disk under --work (source, spill, output); deleted at the
end unless --keep. Timings are this machine's; nothing asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_SRC = REPO / "tests" / "_fixtures" / "llama_cpp_src"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GGUF_STACK = {"gate_proj": "blk.0.ffn_gate_exps.weight", "up_proj": "blk.0.ffn_up_exps.weight",
              "down_proj": "blk.0.ffn_down_exps.weight"}
EXPERTS_PER_SHARD = 16


def _expert_shape(proj: str, hidden: int, ffn: int) -> tuple[int, int]:
    """[out, in] of one expert's projection."""
    return (hidden, ffn) if proj == "down_proj" else (ffn, hidden)


def _expert_bytes(e: int, proj: str, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight_packed uint8 [rows, cols/2], weight_scale uint8 [rows, cols/32]) of one expert, seeded by
    (expert, projection): random nibbles (every E2M1 code, both signs) and E8M0 exponents 2^-10 .. 2^-1."""
    rows, cols = _expert_shape(proj, hidden, ffn)
    rng = np.random.default_rng([e, PROJECTIONS.index(proj)])
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(117, 127, size=(rows, cols // 32), dtype=np.uint8)
    return packed, scale


def build_source(out: Path, experts: int, hidden: int, ffn: int) -> Path:
    """The synthetic checkpoint: dense bf16 attention / router / shared expert / embeddings (tiny MLA ranks,
    4 heads), compressed-tensors MXFP4 routed experts in shards of EXPERTS_PER_SHARD experts, written one
    expert at a time."""
    import torch
    from safetensors.numpy import save_file as save_np
    from safetensors.torch import save_file as save_torch

    sys.path.insert(0, str(REPO / "tests" / "support"))
    import fixtures

    out.mkdir(parents=True, exist_ok=True)
    rank, nope, rope, v = 64, 32, 16, 32
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": fixtures.VOCAB_SIZE,
        "hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": experts, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": rank, "kv_lora_rank": rank,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                            "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8"}}},
            "ignore": ["lm_head"]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    fixtures.build_tokenizer(out)

    gen = torch.Generator().manual_seed(0)

    def dense(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    p = "model.layers.0."
    small = {
        "model.embed_tokens.weight": torch.randn(fixtures.VOCAB_SIZE, hidden, generator=gen).to(torch.bfloat16),
        "lm_head.weight": dense(fixtures.VOCAB_SIZE, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "self_attn.q_a_proj.weight": dense(rank, hidden),
        p + "self_attn.q_a_layernorm.weight": torch.ones(rank, dtype=torch.bfloat16),
        p + "self_attn.q_b_proj.weight": dense(4 * (nope + rope), rank),
        p + "self_attn.kv_a_proj_with_mqa.weight": dense(rank + rope, hidden),
        p + "self_attn.kv_a_layernorm.weight": torch.ones(rank, dtype=torch.bfloat16),
        p + "self_attn.kv_b_proj.weight": dense(4 * (nope + v), rank),
        p + "self_attn.o_proj.weight": dense(hidden, 4 * v),
        p + "mlp.gate.weight": dense(experts, hidden),
        p + "mlp.gate.e_score_correction_bias": torch.zeros(experts, dtype=torch.float32),
        p + "mlp.shared_experts.gate_proj.weight": dense(ffn, hidden),
        p + "mlp.shared_experts.up_proj.weight": dense(ffn, hidden),
        p + "mlp.shared_experts.down_proj.weight": dense(hidden, ffn),
    }
    weight_map = {}
    n_shards = 1 + (experts + EXPERTS_PER_SHARD - 1) // EXPERTS_PER_SHARD
    shard = f"model-00001-of-{n_shards:05d}.safetensors"
    save_torch(small, str(out / shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in small})
    for i, first in enumerate(range(0, experts, EXPERTS_PER_SHARD)):
        shard = f"model-{i + 2:05d}-of-{n_shards:05d}.safetensors"
        tensors = {}
        for e in range(first, min(first + EXPERTS_PER_SHARD, experts)):
            for proj in PROJECTIONS:
                packed, scale = _expert_bytes(e, proj, hidden, ffn)
                tensors[f"{p}mlp.experts.{e}.{proj}.weight_packed"] = packed
                tensors[f"{p}mlp.experts.{e}.{proj}.weight_scale"] = scale
        save_np(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# runs in the child: the conversion alone, then its own peak RSS and wall time on the last line
_CONVERT = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert
    src, out = map(Path, sys.argv[1:3])
    t0 = time.perf_counter()
    report = convert("compressed-tensors", src, "gguf", out, Options(type="mxfp4"), progress=False)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "verdicts": report.summary()["verdicts"]}))
""")


def convert_in_child(src: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(out)], capture_output=True, text=True,
                          cwd="/tmp", env=env)
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# runs in the child with the sdist's converter (and its vendored gguf-py) first on sys.path: every expert of
# every stack against llama.cpp's own repack of the source bytes, one expert at a time
_VERIFY = textwrap.dedent("""
    import json, sys
    src_dir, llama_src, gguf_path, hidden, ffn, experts = sys.argv[1:7]
    hidden, ffn, experts = int(hidden), int(ffn), int(experts)
    sys.path.insert(0, llama_src)
    sys.path.insert(0, llama_src + "/gguf-py")
    import numpy as np, torch
    from conversion.base import ModelBase
    import gguf
    from safetensors import safe_open
    stacks = json.loads(sys.argv[7])
    index = json.load(open(src_dir + "/model.safetensors.index.json"))["weight_map"]
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    checked, nbytes = 0, 0
    handles = {}
    for proj, name in stacks.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4, (name, t.tensor_type)
        assert t.data.shape[0] == experts, (name, t.data.shape)
        for e in range(experts):
            key = f"model.layers.0.mlp.experts.{e}.{proj}.weight_packed"
            shard = index[key]
            if shard not in handles:
                handles.clear()
                handles[shard] = safe_open(src_dir + "/" + shard, "pt")
            f = handles[shard]
            packed, scale = f.get_tensor(key), f.get_tensor(key.replace("_packed", "_scale"))
            want = ModelBase.repack_mxfp4_blocks(packed, scale)
            got = np.asarray(t.data[e])
            if got.shape != want.shape or not np.array_equal(got, want):
                raise SystemExit(f"{name} expert {e}: bytes differ from llama.cpp's repack")
            checked += 1
            nbytes += want.nbytes
    print(json.dumps({"experts_checked": checked, "bytes_equal": nbytes}))
""")


def verify_in_child(src: Path, out: Path, hidden: int, ffn: int, experts: int) -> dict:
    if not (LLAMA_CPP_SRC / "conversion" / "base.py").is_file():
        raise SystemExit(f"no llama.cpp converter in {LLAMA_CPP_SRC}: run scripts/test_env.d/30-llama-cpp-src.sh")
    proc = subprocess.run([sys.executable, "-c", _VERIFY, str(src), str(LLAMA_CPP_SRC), str(out), str(hidden),
                           str(ffn), str(experts), json.dumps(GGUF_STACK)], capture_output=True, text=True, cwd="/tmp")
    if proc.returncode != 0:
        raise SystemExit(f"byte comparison failed:\n{proc.stderr[-4000:]}{proc.stdout[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconvert-giant-layer"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and GGUFs under --work")
    a = ap.parse_args()

    one_expert = sum((r * c // 2 + r * c // 32) for r, c in (_expert_shape(p, a.hidden, a.ffn) for p in PROJECTIONS)) // 3
    layer = 3 * a.experts * one_expert
    layer_weights = 3 * a.experts * a.hidden * a.ffn
    a.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(a.work).free
    if free < 3.2 * layer:
        raise SystemExit(f"{a.work}: {free / 1e9:.1f} GB free, the run needs {3.2 * layer / 1e9:.1f} GB")
    print(f"layer: {a.experts} experts x 3 projections, hidden {a.hidden}, expert width {a.ffn}: "
          f"{layer / 1e9:.2f} GB of MXFP4 experts, {one_expert / 1e6:.2f} MB per expert tensor")
    try:
        small_src, small_out = a.work / "baseline-src", a.work / "baseline.gguf"
        build_source(small_src, 4, 256, 128)
        base = convert_in_child(small_src, small_out)

        src, out = a.work / "src", a.work / "layer.gguf"
        t0 = time.perf_counter()
        build_source(src, a.experts, a.hidden, a.ffn)
        print(f"built the source in {time.perf_counter() - t0:.1f} s")
        got = convert_in_child(src, out)
        grown = got["peak_rss"] - base["peak_rss"]
        print(f"qconvert ct->gguf --type mxfp4: {got['seconds']:.1f} s ({layer / got['seconds'] / 1e6:.0f} MB/s), "
              f"verdicts {got['verdicts']}")
        print(f"peak RSS {got['peak_rss'] / 1e6:.0f} MB; baseline (4 experts, 256 wide) {base['peak_rss'] / 1e6:.0f} MB; "
              f"grown {grown / 1e6:.0f} MB = {grown / one_expert:.1f} expert tensors "
              f"= {grown / layer * 100:.2f}% of the layer's experts")
        t0 = time.perf_counter()
        check = verify_in_child(src, out, a.hidden, a.ffn, a.experts)
        print(f"byte for byte against llama.cpp's repack_mxfp4_blocks: {check['experts_checked']} expert tensors, "
              f"{check['bytes_equal'] / 1e9:.2f} GB equal ({time.perf_counter() - t0:.1f} s)")
        # what the plan held per grid between planning and writing before the records dropped their
        # parameters once planned: the E8M0 scales and the float grid's zero points, one byte each per 32 weights
        per_group = 2 * layer_weights // 32
        print(f"for scale: every grid's per-group parameters (E8M0 scales + int8 zero points, 2 bytes per 32 "
              f"weights) are {per_group / 1e6:.0f} MB; they are no longer held from planning to writing")
        print(f"peak RSS grown by {grown / one_expert:.1f} expert tensors' source bytes "
              f"({grown / (4 * a.hidden * a.ffn):.1f} float32 expert tensors), not with the layer")
        if grown > layer / 4:
            raise SystemExit("memory grew by more than a quarter of the layer: the experts' codes were not streamed")
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
