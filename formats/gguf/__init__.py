"""GGUF (llama.cpp): layout facts in kernels.ggml_layouts, names/metadata/tokenizer here, the writer."""

from pathlib import Path

from ...converters.registry import FormatEntry, register_format
from .reader import open_gguf
from .writer import GgufWriter

def _is_gguf(path: Path) -> bool:
    """A GGUF file starts with the magic b"GGUF" (the data decides, not the file name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


register_format(FormatEntry("gguf", aliases=("llama.cpp", "ggml"),
                            description="llama.cpp GGUF file: complete model with metadata and tokenizer",
                            open_reader=open_gguf, writer=GgufWriter(), sniff=_is_gguf))
