"""Qwen3-VL (`qwen3_vl`, and `qwen3_vl_moe` with sparse MLPs), natively: the shared Qwen vision tower
with DeepStack (qwen_vl/) and a text model whose every layer is full attention."""
