"""ggml's block formats: layouts (sizes from gguf-py), the legacy, K and IQ quantizers and dequantizers with
their C twins, byte for byte equal to ggml's own, the GPTQ -> Q4_0 word repack, and the bridge to libggml."""
