"""batchvlm: label image datasets with vision-language models."""

__version__ = "0.1.0"
