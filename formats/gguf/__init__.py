"""GGUF (llama.cpp): layout facts in kernels.ggml.layouts, names/metadata/tokenizer here, the writer."""

from pathlib import Path

from ...converters.registry import FormatEntry, OptionSpec, register_format
from ...kernels.ggml.layouts import LAYOUTS, TARGET_LAYOUTS
from ..common.ggml_codec import QUANTIZERS
from .presets import PRESETS
from .folder import GGUF_MAGIC, is_gguf_folder, open_gguf
from .writer import GgufWriter

def _is_gguf(path: Path) -> bool:
    """A GGUF file starts with the magic b"GGUF" (the data decides, not the file name); a folder holding
    GGUF files and no other weights is read as its model (folder.py)."""
    path = Path(path)
    if path.is_dir():
        return is_gguf_folder(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# the --type vocabulary as the writer's _parse_type and presets read it: every ggml type it writes, then
# llama-quantize's mixes (q2_k, q6_k and q8_0 name both a type and a mix; as --type they are the mix)
_TYPE_HELP = (", ".join(t.lower() for t in TARGET_LAYOUTS) + "; llama-quantize mixes: "
              + ", ".join(p for p in PRESETS if p.upper() not in LAYOUTS)
              + ", and as --type also " + ", ".join(p for p in PRESETS if p.upper() in LAYOUTS))

_OPTIONS = (
    OptionSpec("--split-max-size", "split_max_size", "size", metavar="SIZE",
               help="gguf: split the output into parts of at most SIZE (e.g. 500M, 2G) named "
                    "OUT-0000i-of-0000N.gguf"),
    OptionSpec("--imatrix", "imatrix", "path",
               help="gguf: llama.cpp importance matrix (llama-imatrix .dat or GGUF) weighting the K quantizers "
                    "as llama-quantize --imatrix does"),
    OptionSpec("--quantizer", "quantizer", "choice", choices=QUANTIZERS,
               help="gguf: whose quantizer requantizes (default qconvert's own; llama.cpp needs "
                    "llama-cpp-python)"),
    OptionSpec("--no-mtp", "no_mtp", "flag",
               help="gguf: leave out the multi-token-prediction block (GLM-4.5/5, Qwen3.5, Qwen3-Next), as "
                    "llama.cpp's converter does with --no-mtp; by default it is kept, as the converter keeps it"),
)

register_format(FormatEntry("gguf", aliases=("llama.cpp", "ggml"),
                            description="llama.cpp GGUF file (or a folder holding one): complete model with metadata "
                                        "and tokenizer",
                            open_reader=open_gguf, writer=GgufWriter(), sniff=_is_gguf,
                            options=_OPTIONS, type_help=_TYPE_HELP,
                            examples=("qconvert 'gptq->gguf' model-gptq/ model.gguf",
                                      "qconvert 'hf->gguf' model/ model-q4_k_m.gguf --type q4_k_m --allow-requant",
                                      "qconvert convert model-gptq/ model.gguf --to gguf --split-max-size 2G")))
