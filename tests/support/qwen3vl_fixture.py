"""Tiny random Qwen3-VL checkpoints in the hub layout, written by transformers itself.

The weights are drawn here with a wider spread than transformers' 0.02 init, so greedy choices
are decided by clear logit margins (near ties would make token parity a coin toss between two
correct float32 implementations). transformers saves them (sharded, with the index), and the
tokenizer is a byte-level BPE with Qwen's special tokens, built with `tokenizers` (offline).

`moe=dict(experts=, top_k=, ff=[, dense_layers=])` makes the `qwen3_vl_moe` variant (Qwen3VLMoeForConditionalGeneration)
with its expert tensors rewritten in the released checkpoints' transposed layout
([E, C, 2I] / [E, I, C], which transformers reads back by shape).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
FIRST_SPECIAL = 256
IDS = {s: FIRST_SPECIAL + i for i, s in enumerate(SPECIALS)}
VOCAB = 272

# In the style of Qwen3-VL's own template: no default system turn, images as
# <|vision_start|><|image_pad|><|vision_end|> in place, generation prompt on request.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- else -%}{%- for content in message.content -%}"
    "{%- if content.type == 'image' or 'image' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}{{- content.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def byte_tokenizer(corpus: str | None = None, vocab: int = VOCAB) -> Tokenizer:
    """Byte-level BPE: the 256 bytes, Qwen's special tokens at 256..., and (with a corpus) merges
    learned from it filling the vocabulary up to `vocab` (so prompts have realistic lengths)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    table = {ch: i for i, ch in enumerate(alphabet)} | {s: FIRST_SPECIAL + i for i, s in enumerate(SPECIALS)}
    merges: list[tuple[str, str]] = []
    if corpus:
        from tokenizers import trainers

        learner = Tokenizer(models.BPE())
        learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        learner.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS),
                                                                  initial_alphabet=alphabet, show_progress=False))
        for m in json.loads(learner.to_str())["model"]["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            if a + b not in table and len(table) < vocab:
                table[a + b] = len(table)
                merges.append((a, b))
    tok = Tokenizer(models.BPE(table, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.token_to_id("<|image_pad|>") == IDS["<|image_pad|>"]
    return tok


def hf_config(text_dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2,
              section: tuple[int, int, int] = (2, 1, 1), vision_dim: int = 32, vision_heads: int = 4,
              depth: int = 2, pos_embeddings: int = 16, deepstack: tuple[int, ...] = (0, 1), tie: bool = False,
              patch: int = 16, ff: int | None = None, vision_ff: int | None = None, vocab: int = VOCAB,
              moe: dict | None = None):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(vocab_size=vocab, hidden_size=text_dim, intermediate_size=ff or 2 * text_dim,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=8192, tie_word_embeddings=tie, **moe_fields(moe),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": list(section), "mrope_interleaved": True}),
        vision_config=dict(depth=depth, hidden_size=vision_dim, intermediate_size=vision_ff or 2 * vision_dim,
                           num_heads=vision_heads, out_hidden_size=text_dim, num_position_embeddings=pos_embeddings,
                           deepstack_visual_indexes=list(deepstack), patch_size=patch),
        image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
        vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"],
        tie_word_embeddings=tie)


def moe_fields(moe: dict | None, shared: int = 0) -> dict:
    """transformers' text config fields of an MoE variant (`shared`: the shared expert's width)."""
    if not moe:
        return {}
    fields = dict(num_experts=moe["experts"], num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["ff"])
    if "dense_layers" in moe:
        fields["mlp_only_layers"] = list(moe["dense_layers"])
    return fields | ({"shared_expert_intermediate_size": shared} if shared else {})


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                t = 1 + 0.1 * t
            elif name.endswith("bias"):
                t = 0.05 * t
            elif "embed_tokens" in name or "pos_embed" in name:
                t = t * 1.0
            elif "experts" in name and p.dim() == 3:  # stacked experts [E, out, in]
                t = t / p.shape[-1] ** 0.5
            elif p.dim() > 1:
                t = t / p[0].numel() ** 0.5
            p.copy_(t)


def make_stops_likely(model: torch.nn.Module) -> None:
    """Give <|im_end|> the output row, scaled by 1.1, of a token this model writes mid-answer
    (the 16th token of a greedy text-only answer): <|im_end|> then wins wherever that token would,
    by a 10% logit margin (no near tie), so some sequences end by themselves before the limit."""
    tok = byte_tokenizer()
    ids = torch.tensor([tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids])
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             eos_token_id=IDS["<|im_end|>"], pad_token_id=IDS["<|endoftext|>"])
    with torch.no_grad():
        model.lm_head.weight[IDS["<|im_end|>"]] = 1.1 * model.lm_head.weight[gen[0, -1]]


def write_checkpoint(dest: Path, seed: int = 0, likely_stops: bool = False, corpus: str | None = None,
                     min_pixels: int = 32 * 32, max_pixels: int = 256 * 256,
                     shard_size: str = "40KB", mean: tuple[float, ...] = (0.5, 0.5, 0.5),
                     std: tuple[float, ...] = (0.5, 0.5, 0.5), dtype: torch.dtype = torch.float32,
                     **config) -> Path:
    """A hub-layout folder: sharded safetensors + index, config, tokenizer, template, processor."""
    cfg = hf_config(**config)
    name = "Qwen3VLMoeForConditionalGeneration" if config.get("moe") else "Qwen3VLForConditionalGeneration"
    save(dest, name, cfg, seed, likely_stops, shard_size, dtype)
    if config.get("moe"):
        transpose_experts(dest)
    return write_host_files(dest, cfg, CHAT_TEMPLATE, corpus, min_pixels, max_pixels, mean, std)


def save(dest: Path, model_class: str, cfg, seed: int, likely_stops: bool, shard_size: str, dtype: torch.dtype) -> None:
    """A transformers model of `cfg`, randomized, saved sharded by transformers."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    randomize(model, seed)
    if likely_stops:
        make_stops_likely(model)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.to(dtype).save_pretrained(dest, max_shard_size=shard_size)


def transpose_experts(dest: Path) -> None:
    """Rewrite the stacked expert tensors [E, out, in] as [E, in, out] (the released Qwen3-VL-MoE
    layout), shard by shard."""
    from safetensors.torch import load_file, save_file

    for path in dest.glob("*.safetensors"):
        tensors = load_file(path)
        if any(".experts." in k for k in tensors):
            save_file({k: t.transpose(1, 2).contiguous() if ".experts." in k else t for k, t in tensors.items()},
                      path, metadata={"format": "pt"})


def write_host_files(dest: Path, cfg, chat_template: str, corpus: str | None = None, min_pixels: int = 32 * 32,
                     max_pixels: int = 256 * 256, mean: tuple[float, ...] = (0.5, 0.5, 0.5),
                     std: tuple[float, ...] = (0.5, 0.5, 0.5)) -> Path:
    """Tokenizer, template, processor and generation config beside the weights."""
    byte_tokenizer(corpus, cfg.text_config.vocab_size).save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 8192, "clean_up_tokenization_spaces": False}))
    (dest / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": min_pixels,
                                                                 "longest_edge": max_pixels},
        "patch_size": cfg.vision_config.patch_size, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": list(mean), "image_std": list(std), "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}))
    (dest / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [IDS["<|im_end|>"], IDS["<|endoftext|>"]], "pad_token_id": IDS["<|endoftext|>"]}))
    return dest
