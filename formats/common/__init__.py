"""What several formats share: the Hugging Face checkpoint folder and its safetensors headers, float grids,
the ggml block codec that GGUF and UQFF both write, and the reader preamble that reads quantization_config."""
