"""MLX (mlx-lm's model folder): quantized linears as mlx affine grids, W = scales * q + biases.

packing.py: mlx's bit packing and its affine quantizer rule (mx.quantize) in torch; schemes.py: the
target types and the "mlx" family handler of the alignment checker; reader.py / writer.py. The facts are
mlx 0.32.4's (mlx/backend/cpu/quantized.cpp) and mlx-lm 0.32.2's (utils.py load_model, quantize_model,
save_config), checked against both by tests/formats/mlx/test_mlx.py through tests/support/mlx_driver.py.
"""

from ...converters.registry import FormatEntry, OptionSpec, register_format
from .reader import looks_like_mlx, open_mlx
from .schemes import TYPE_HELP
from .writer import MlxWriter

register_format(FormatEntry("mlx", aliases=("mlx-lm", "mlx_lm"),
                            description="mlx-lm model folder (affine 2/3/4/5/6/8-bit groups of 32/64/128, "
                                        "scales and biases in the model dtype)",
                            open_reader=open_mlx, writer=MlxWriter(), sniff=looks_like_mlx, type_help=TYPE_HELP,
                            options=(OptionSpec("--scale-dtype", "scale_dtype", "choice",
                                                choices=("float16", "bfloat16", "float32"),
                                                help="mlx: the dtype of scales and biases (default the model's); "
                                                     "float32 keeps a float16 GPTQ grid exact (mlx then "
                                                     "decodes s*q + b in float32: s*(q - z) unrounded)"),),
                            examples=("qconvert 'gptq->mlx' model-gptq/ model-mlx/",
                                      "qconvert 'hf->mlx' model/ model-mlx/ --type mlx4g64 --allow-requant")))
