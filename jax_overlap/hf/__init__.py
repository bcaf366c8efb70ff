"""Hugging Face interop: `config.json` + safetensors in and out (docs/guides/data_and_hf.md)."""
