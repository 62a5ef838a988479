"""Remake tests/producer_fixtures/gptq_qwen35/: gptqmodel's own 4-bit group-32 GPTQ of the tiny Qwen3.5.

    .venv/bin/python scripts/producers/gptqmodel_qwen35.py

The producer is gptqmodel (the .venv's, on CPU: tests/support/fixtures.py quantize_gptq, its fixed calibration
set and seeds) on tests/support/fixtures_archs.py's qwen3_5 model (hidden 128, three Gated-DeltaNet layers and a
full-attention one, 2 key / 4 value heads, an MTP block beside them). gptqmodel quantizes the linear attention's
in_proj_qkv, in_proj_z and out_proj, the full attention and the MLPs; in_proj_a / in_proj_b, the conv kernel,
A_log, dt_bias and the norms stay float16, the MTP block as the base had it. Beside the folder it stores the
oracle, made by gptqmodel itself: reference.safetensors = dequantize_weight() of every quantized module of the
checkpoint loaded with its torch backend (float16 [out, in], "<module>.weight"), and versions.json.
Quantizing takes about 90 s on 2 CPU cores (the Gated DeltaNet runs its reference torch kernels).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

# _common.py, beside this file, holds the scaffolding the producers share (see its docstring)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.leave_import_path()
OUT = _common.PRODUCER_FIXTURES / "gptq_qwen35"


def main() -> int:
    _common.parser(__doc__).parse_args()
    _common.offline_defaults()
    support = _common.REPO / "tests" / "support"
    sys.path.insert(0, str(support))
    import fixtures  # noqa: E402  (tests/support: the calibration set and gptqmodel's quantize / load)
    import fixtures_archs  # noqa: E402
    import fixtures_moe  # noqa: E402  (moe_gptq_reference: gptqmodel's dequantization of every quant module)
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="qconvert-gptq-qwen35-") as tmp:
        base = fixtures_archs.build_arch_model(Path(tmp) / "base", "qwen3_5")
        ckpt = fixtures.quantize_gptq(base, Path(tmp) / "ckpt", bits=4, group_size=32, sym=True)
        # float16: gptqmodel dequantizes in float16, so nothing is lost (and the file is half the size)
        reference = {name: t.to(torch.float16).contiguous()
                     for name, t in fixtures_moe.moe_gptq_reference(ckpt).items()}
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        shutil.copytree(ckpt, OUT / "model")
        (OUT / "model" / "quant_log.csv").unlink(missing_ok=True)
        save_file(reference, str(OUT / "reference.safetensors"))
        _common.write_versions(OUT, "gptqmodel", ["gptqmodel", "torch", "transformers"],
                               base="tests/support/fixtures_archs.py qwen3_5 (seed 0)", bits=4, group_size=32,
                               sym=True)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
