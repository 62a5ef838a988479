"""What the tests of issue 26's quantized producer fixtures share beyond GGUF (tests/formats/mlx/
test_mlx_archs_quantized.py, tests/formats/uqff/test_uqff_archs_quantized.py): the fixtures themselves and their
helpers are tests/formats/gguf/test_gguf_archs_quantized.py's (FIXTURES, PAIRS, PROMPT), loaded from that file by
`gguf_quantized_test()` (`test_module`: any test file's helpers); this module adds the producer's own model as
transformers runs it.

`producer_folder` is a Hugging Face folder of the producer's dequantization: every module the producer quantized
replaced by its reference.safetensors weight (what gptqmodel's torch kernel / compressed-tensors' decompression
multiply with, float16), every other tensor the checkpoint's own, the quantization_config dropped. A runtime whose
activations cannot be fed as token ids (mistral.rs' Python API takes text, and the fixtures' byte-level prompt ids
do not decode to text that encodes back to them), or that is not the producer's model (mlx-lm's ERNIE drops the
router's correction bias), is judged against transformers (float32) on this folder: the producer's weights, not
ours read back.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PRODUCER_FIXTURES = TESTS / "producer_fixtures"
# what a producer's checkpoint holds for one quantized module besides its float tensors (gptqmodel: qweight,
# qzeros, scales, g_idx; llm-compressor's pack-quantized: weight_packed, weight_scale, weight_zero_point,
# weight_shape, weight_g_idx): every tensor named <module>.<anything but bias> of a module in reference.safetensors
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "generation_config.json", "chat_template.jinja")


def test_module(path: Path):
    """The test file at `path` as a module, to use its helpers: the one pytest imported when it collected that file
    (so its module-level work, such as an environment probe, is not done twice), else loaded here once."""
    import sys

    path = Path(path).resolve()
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path:
            return module
    name = f"qconvert_tests_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def gguf_quantized_test():
    """tests/formats/gguf/test_gguf_archs_quantized.py as a module (its FIXTURES, PAIRS, PROMPT)."""
    return test_module(TESTS / "formats" / "gguf" / "test_gguf_archs_quantized.py")


def producer_folder(fixture: Path, dest: Path, zeroed: str | None = None) -> Path:
    """The producer's dequantized model as a Hugging Face folder (module docstring); `zeroed`: a name suffix
    whose tensors are replaced by zeros (a runtime that ignores them is compared with the model without them).
    Written once per `dest`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if (dest / "model.safetensors").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    reference = load_file(str(fixture / "reference.safetensors"))
    modules = tuple(n[: -len("weight")] for n in reference)  # "model.layers.0.mlp.up_proj."
    tensors = dict(reference)
    with safe_open(str(fixture / "model" / "model.safetensors"), "pt") as f:
        for key in f.keys():
            # a quantized module's bias stays (GLM-4.5's q/k/v_proj have one); its codes and scales go
            if not key.startswith(modules) or key.endswith(".bias"):
                tensors[key] = f.get_tensor(key)
    if zeroed:
        tensors = {k: torch.zeros_like(v) if k.endswith(zeroed) else v for k, v in tensors.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((fixture / "model" / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    for side in _SIDE_FILES:
        if (fixture / "model" / side).exists():
            shutil.copy(fixture / "model" / side, dest / side)
    return dest
