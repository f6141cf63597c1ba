"""Florence-2 (Microsoft, MIT): a DaViT vision tower and a BART-like encoder-decoder, natively.

Checkpoints in transformers' hub layout (`model_type: florence2`, `Florence2ForConditionalGeneration`
weights, e.g. florence-community/Florence-2-base / -large). `prompts.py` is the one mapping of
batchvlm's tasks to Florence-2's task tokens and instructions; the transformers backend uses it too.
"""
