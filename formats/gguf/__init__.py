"""GGUF (llama.cpp): layout facts in kernels.ggml_layouts, names/metadata/tokenizer here, the writer."""

from ...converters.registry import FormatEntry, register_format
from .writer import GgufWriter

register_format(FormatEntry("gguf", aliases=("llama.cpp", "ggml"),
                            description="llama.cpp GGUF file: complete model with metadata and tokenizer",
                            writer=GgufWriter()))
