"""HQQ checkpoints (hqq 0.2.x, and the transformers integration that wraps it), read and written.

An HQQ linear is self-describing: packed codes `W_q`, a float `scale` (already inverted) and a float
`zero` per group, and its own nbits / group_size / axis / packing / compute dtype, so a model may mix
settings layer by layer. W = (q - zero) * scale, computed by hqq in the layer's compute dtype. Three
containers hold the same per-layer state (hqq 0.2.8's `HQQLinear.state_dict`, hqq/core/quantize.py):

* transformers `save_pretrained` (also hqq's `save_to_safetensors`): safetensors, 19 flat tensors per layer
  `<module>.W_q`, `.scale`, `.zero`, ... (20 with `.bias`); ints, bools, strings and dtypes encoded as
  small tensors. config.json carries `quantization_config` {quant_method "hqq", quant_config, skip_modules}.
* hqq's `save_quantized`: one `qmodel.pt` torch pickle {module: {key: python value}} + config.json without
  quantization_config. Read with `torch.load(weights_only=True)` only: a file that needs any other object
  is refused, never unpickled.
* hqq <= 0.1.8 qmodel.pt: {module: {"W_q", "meta": {...}, "bias"}}.

Dtype strings ("torch.float16") map through a whitelist, never `eval`. Grids keep hqq's axis: axis 1 is
the usual per-row group of `group_size` inputs; axis 0 is hqq's strided-row group (converters/records.py).

Writing emits either container (`--type safetensors` (default for non-HQQ sources) or `--type qmodel`;
default for an HQQ source: its own container), with every key hqq 0.2.8 and transformers 4.57.6 need.
HQQ grids and integer-zero grids (GPTQ) are written exactly; anything else, and any `--type` scheme such as
`4g64a0` (bits, group size, axis) that differs from the source, is quantized with hqq's own rule
(kernels/hqq.py) and needs --allow-requant.

The rooms: layer.py (one layer's state, decoded and checked, and its grid), reader.py (the transformers
safetensors folder; open_hqq / sniff_hqq), qmodel.py (the qmodel.pt pickle), folder.py (what both share),
schemes.py (the --type vocabulary and the checker's `hqq` family), writer.py.
"""

from ...converters.registry import FormatEntry, register_format
from .layer import SUPPORTED_BITS
from .reader import HqqSafetensorsSource, open_hqq, sniff_hqq
from .qmodel import HqqPickleSource
from .schemes import HQQ_KEEP
from .writer import HqqWriter

__all__ = ["HqqSafetensorsSource", "HqqPickleSource", "HqqWriter", "HQQ_KEEP", "open_hqq"]

register_format(FormatEntry("hqq", aliases=("hqq-lib",),
                            description="HQQ: transformers safetensors (19 keys per layer) or hqq qmodel.pt "
                                        "(also the <=0.1.8 W_q/meta layout); any bits/group/axis per layer",
                            open_reader=open_hqq, writer=HqqWriter(), sniff=sniff_hqq,
                            # the --type vocabulary as parse_hqq_type reads it
                            type_help="a container (safetensors, qmodel) and/or a scheme BITSgGROUP[aAXIS], bits "
                                      f"{', '.join(map(str, SUPPORTED_BITS))}, axis 1 (default) or 0: 4g64, 4g64a0, "
                                      "qmodel:3g64a1; without a scheme each grid keeps its own, without a container "
                                      "the source's (else safetensors)",
                            examples=("qconvert 'gptq->hqq' model-gptq/ model-hqq/",
                                      "qconvert 'hf->hqq' model/ model-hqq/ --type qmodel:4g64 --allow-requant")))
