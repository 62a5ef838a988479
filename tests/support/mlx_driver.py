"""The mlx side of tests/formats/mlx/test_mlx.py, run with the mlx environment's python (.venvs/mlx, made by
scripts/test_env.d/40-mlx.sh): mlx and mlx-lm judge and produce here, never qconvert (not installed there).

    load MODEL_DIR OUT.safetensors IDS_JSON [N_NEW]   mlx_lm.load the folder; write every quantized module's
        (a MoE switch layer's: [experts, out, in]) mx.dequantize (its own dtype, bfloat16 as float32, "<module>.weight"), the logits of IDS ("__logits__", float32 [T, vocab]) and
        N_NEW greedy tokens from mlx_lm.generate's own loop (generate_step), as "__generated__"; print a JSON
        summary of the quantized modules (bits, group_size, mode) on stdout
    load-many JOBS_JSON                               `load` for each [MODEL_DIR, OUT, IDS, N_NEW] of the list in one
        process (mlx and mlx-lm imported once); one JSON summary line per folder, in order
    quantize IN.safetensors OUT.safetensors           mx.quantize every float tensor "w@BITS@GROUP" (mode affine):
        "<key>.q" (uint32 words), "<key>.scales", "<key>.biases"
    convert HF_DIR OUT_DIR BITS GROUP [MODE]          mlx_lm.convert(quantize=True, q_mode=MODE, default affine): the
        producer of mlx folders (mxfp8 / mxfp4: E4M3 / E2M1 codes with an E8M0 exponent per 32, no biases)
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np


def _load(model_dir: str, out: str, ids_json: str, n_new: int = 0) -> None:
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(model_dir)
    ids = json.loads(ids_json)
    tensors: dict[str, np.ndarray] = {}
    modules = {}
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    for name, mod in model.named_modules():
        # a QuantizedSwitchLinear (a MoE layer's stacked experts) dequantizes the same way, [experts, out, in]
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            # the float modes' default output is bfloat16, which rounds E8M0 * E4M3 products no value of the
            # grid needs rounded (below bfloat16's normals): asked in float32, mlx gives the products themselves
            wide = {} if mod.mode == "affine" else {"dtype": mx.float32}
            w = mx.dequantize(mod.weight, mod.scales, mod.biases, group_size=mod.group_size, bits=mod.bits,
                              mode=mod.mode, **wide)
            # in the model dtype mlx decodes in (float16 is exact in numpy; bfloat16 goes through float32)
            tensors[f"{name}.weight"] = np.array(w.astype(mx.float32) if w.dtype == mx.bfloat16 else w)
            modules[name] = {"bits": mod.bits, "group_size": mod.group_size, "mode": mod.mode,
                             "dtype": str(mod.scales.dtype)}
    dense = {k: str(v.dtype) for k, v in tree_flatten(model.parameters()) if not k.rsplit(".", 1)[0] in modules}
    logits = model(mx.array([ids]))[0]
    tensors["__logits__"] = np.array(logits.astype(mx.float32))
    generated = []
    if n_new:
        for token, _ in generate_step(mx.array(ids), model, max_tokens=n_new):
            generated.append(int(token))
    tensors["__generated__"] = np.array(generated, dtype=np.int64)
    from safetensors.numpy import save_file

    save_file(tensors, out)
    print(json.dumps({"quantized": modules, "dense": dense, "generated": generated,
                      "text": tokenizer.decode(generated)}))


def _quantize(src: str, out: str) -> None:
    from safetensors.numpy import load_file, save_file

    result = {}
    for key, value in load_file(src).items():
        _, bits, group, dtype = key.split("@")
        w = mx.array(value.astype(np.float32)).astype(getattr(mx, dtype))
        q, s, b = mx.quantize(w, group_size=int(group), bits=int(bits), mode="affine")
        result[f"{key}.q"] = np.array(q)
        result[f"{key}.scales"] = np.array(s.astype(mx.float32))
        result[f"{key}.biases"] = np.array(b.astype(mx.float32))
    save_file(result, out)


def _convert(hf_dir: str, out_dir: str, bits: str, group: str, mode: str = "affine") -> None:
    from mlx_lm import convert

    convert(hf_dir, out_dir, quantize=True, q_bits=int(bits), q_group_size=int(group), q_mode=mode)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "load":
        _load(args[0], args[1], args[2], int(args[3]) if len(args) > 3 else 0)
    elif cmd == "load-many":
        for model_dir, out, ids, n_new in json.loads(args[0]):
            _load(model_dir, out, json.dumps(ids), int(n_new))
    elif cmd == "quantize":
        _quantize(*args)
    elif cmd == "convert":
        _convert(*args)
    else:
        raise SystemExit(f"unknown command {cmd!r}")
