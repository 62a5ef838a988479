"""`hf`: a dense Hugging Face checkpoint (fp32 / fp16 / bf16 safetensors) in and out.

Reading (reader.py) yields every tensor as `Dense`. Writing (writer.py) dequantizes grids (float32 math, one
rounding to the target dtype) and writes sharded safetensors plus config.json and the tokenizer files, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result.
"""

from ...converters.registry import FormatEntry, register_format
from .reader import HfSource, sniff_hf
from .writer import HF_TYPES, HfWriter

__all__ = ["HfSource", "HfWriter", "HF_TYPES"]

register_format(FormatEntry("hf", aliases=("safetensors", "dense", "transformers"), extras={"generic": True},
                            description="dense Hugging Face safetensors checkpoint (f32/f16/bf16)",
                            open_reader=lambda path, **_: HfSource(path), writer=HfWriter(), sniff=sniff_hf,
                            # the --type vocabulary as writer.parse_hf_type reads it (bf16 when none is given)
                            type_help=", ".join(t.lower() for t in HF_TYPES) + " (default bf16)",
                            examples=("qconvert convert model.gguf model-hf/ --to hf",
                                      "qconvert 'gptq->hf' model-gptq/ model-hf/ --type f32")))
