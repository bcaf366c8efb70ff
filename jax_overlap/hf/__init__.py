"""Hugging Face interop: `config.json` + safetensors in and out (docs/llama_and_hf.md)."""
