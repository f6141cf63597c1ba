"""Qwen3.5 (`qwen3_5`, and `qwen3_5_moe` with sparse MLPs and a shared expert), natively: the shared
Qwen vision tower (qwen_vl/) and a hybrid text model, Gated DeltaNet layers with a recurrent state
between full-attention layers."""
