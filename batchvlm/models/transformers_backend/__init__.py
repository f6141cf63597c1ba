"""Any image-text-to-text model transformers ships, as a family whose device side batches by itself
(`generate`). Chosen for a model_type batchvlm has no native family for, or by model.backend."""
