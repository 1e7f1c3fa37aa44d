"""mmpipe: vision-language models trained as DeepSpeed pipelines."""
__version__ = "0.1.0"
