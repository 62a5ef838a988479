"""qconvert: move quantized LLM checkpoints between ecosystems, keeping the codes where grids align."""

__version__ = "0.1.0"
