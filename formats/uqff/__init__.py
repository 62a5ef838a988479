"""UQFF (mistral.rs "Universal Quantized File Format" 1.x): a model directory of `<stem>-N.uqff`
safetensors shards holding self-describing quantized layers, `residual.safetensors` for every other
tensor, and the model's config and tokenizer files. mistral.rs loads it with `from_uqff`.

The shared facts (tags, versions, the writable types): layout.py; one codec per layer tag, reading and
writing that tag's layers: codecs/; the container (shard sets, residual tensors, stacked experts, the record
stream): reader.py; planning and the output's shards: writer.py. The layouts are mistral.rs 0.9.5's:
mistralrs-quant/src/uqff/ for the container, mistralrs-quant/src/<family>/mod.rs for each layer type.
"""

from pathlib import Path

from ...converters.registry import FormatEntry, register_format
from .layout import UQFF_TYPES
from .reader import is_uqff_file, open_uqff

from .writer import UqffWriter


def _sniff(path: Path) -> bool:
    """A `.uqff` shard (by its safetensors header) or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        return any(is_uqff_file(p) for p in path.glob("*.uqff"))
    return path.is_file() and is_uqff_file(path)


# the --type vocabulary as the writer's parse_uqff_type reads it (mistral.rs' ISQ names)
_TYPE_HELP = (", ".join(UQFF_TYPES) + " (mistral.rs' ISQ names; q4_k is read as q4k); without --type a "
              "quantized layer keeps its GGUF type or gets the cheapest type that holds its grid")

register_format(FormatEntry("uqff", aliases=("mistral.rs", "mistralrs"),
                            description="mistral.rs UQFF 1.x model directory (GGUF blocks, HQQ, AFQ, FP8, F8Q8, "
                                        "MXFP4, unquantized layers)",
                            open_reader=open_uqff, writer=UqffWriter(), sniff=_sniff, type_help=_TYPE_HELP,
                            examples=("qconvert 'gguf->uqff' model.gguf model-uqff/",
                                      "qconvert 'gptq->uqff' model-gptq/ model-uqff/ --type afq4")))
