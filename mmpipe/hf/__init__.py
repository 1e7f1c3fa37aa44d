"""Hugging Face interop: configs and weights in and out (mmpipe.hf.llava, mmpipe.hf.safetensors_io)."""
