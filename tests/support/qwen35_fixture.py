"""Tiny random Qwen3.5 checkpoints in the hub layout, written by transformers itself
(Qwen3_5ForConditionalGeneration), with the tokenizer, processor and weight spread of the
Qwen3-VL fixture (qwen3vl_fixture.py) and a chat template in the style of Qwen3.5's own: after
the assistant header it opens a thinking block, or writes an empty one with enable_thinking false.
`moe=dict(experts=, top_k=, ff=, shared=)` makes the `qwen3_5_moe` variant
(Qwen3_5MoeForConditionalGeneration, saved as transformers saves it: one tensor per expert).
"""

from __future__ import annotations

from pathlib import Path

import torch
from support.qwen3vl_fixture import CHAT_TEMPLATE, IDS, VOCAB, moe_fields, save, write_host_files

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}")
assert THINKING_TEMPLATE != CHAT_TEMPLATE


def hf_config(text_dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 4,
              layer_types: list[str] | None = None, partial_rotary: float = 0.5,
              section: tuple[int, int, int] = (2, 1, 1),
              lin_k_heads: int = 2, lin_v_heads: int = 4, lin_k_dim: int = 8, lin_v_dim: int = 8, conv_kernel: int = 4,
              vision_dim: int = 32, vision_heads: int = 4, depth: int = 2, pos_embeddings: int = 16,
              tie: bool = False, patch: int = 16, ff: int | None = None, vision_ff: int | None = None,
              vocab: int = VOCAB, moe: dict | None = None):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=dict(vocab_size=vocab, hidden_size=text_dim, intermediate_size=ff or 2 * text_dim,
                         **moe_fields(moe, moe["shared"] if moe else 0),
                         num_hidden_layers=layers, layer_types=layer_types, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=8192,
                         tie_word_embeddings=tie, linear_num_key_heads=lin_k_heads, linear_num_value_heads=lin_v_heads,
                         linear_key_head_dim=lin_k_dim, linear_value_head_dim=lin_v_dim,
                         linear_conv_kernel_dim=conv_kernel,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": partial_rotary,
                                          "mrope_section": list(section), "mrope_interleaved": True}),
        vision_config=dict(depth=depth, hidden_size=vision_dim, intermediate_size=vision_ff or 2 * vision_dim,
                           num_heads=vision_heads, out_hidden_size=text_dim, num_position_embeddings=pos_embeddings,
                           patch_size=patch),
        image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
        vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"],
        tie_word_embeddings=tie)


def write_checkpoint(dest: Path, seed: int = 0, likely_stops: bool = False, corpus: str | None = None,
                     min_pixels: int = 32 * 32, max_pixels: int = 256 * 256, shard_size: str = "40KB",
                     mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5),
                     dtype: torch.dtype = torch.float32, **config) -> Path:
    """A hub-layout folder: sharded safetensors + index, config, tokenizer, template, processor."""
    cfg = hf_config(**config)
    name = "Qwen3_5MoeForConditionalGeneration" if config.get("moe") else "Qwen3_5ForConditionalGeneration"
    save(dest, name, cfg, seed, likely_stops, shard_size, dtype)
    return write_host_files(dest, cfg, THINKING_TEMPLATE, corpus, min_pixels, max_pixels, mean, std)
