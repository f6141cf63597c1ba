"""SigLIP 2 (NaFlex `siglip2` and the fixed-resolution checkpoints, `siglip`; SigLIP 1 where it
ships a tokenizer.json): an encoder-only family. Its tasks are image-level (embed, classify over
choices by image-text logits, similarity of an image and its own text), run by the engine's
image-level path (engine/images.py): one vision forward per batch, no decode."""
