"""UQFF (mistral.rs "Universal Quantized File Format" 1.x): a model directory of `<stem>-N.uqff`
safetensors shards holding self-describing quantized layers, `residual.safetensors` for every other
tensor, and the model's config and tokenizer files. mistral.rs loads it with `from_uqff`.

Layouts and codecs: layout.py; reading: reader.py; writing: writer.py (shared spec uqff.md).
"""

from pathlib import Path

from ...converters.registry import FormatEntry, register_format
from .reader import is_uqff_file, open_uqff

from .writer import UqffWriter


def _sniff(path: Path) -> bool:
    """A `.uqff` shard (by its safetensors header) or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        return any(is_uqff_file(p) for p in path.glob("*.uqff"))
    return path.is_file() and is_uqff_file(path)


register_format(FormatEntry("uqff", aliases=("mistral.rs", "mistralrs"),
                            description="mistral.rs UQFF 1.x model directory (GGUF blocks, HQQ, AFQ, FP8, F8Q8, "
                                        "MXFP4, unquantized layers)",
                            open_reader=open_uqff, writer=UqffWriter(), sniff=_sniff))
