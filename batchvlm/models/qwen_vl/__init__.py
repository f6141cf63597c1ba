"""What the two native Qwen families (qwen3_vl/, qwen3_5/) share: the vision tower, preprocessing,
chat template, prompts (also the transformers backend's for Qwen checkpoints), labels, and the
host and device sides each family completes with its config, text model and forward."""
