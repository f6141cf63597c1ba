"""Tiny random Hugging Face VLMs, saved in the hub layout, built offline.

Each builder writes a folder as `save_pretrained` lays out a hub repo: config.json,
generation_config.json, model.safetensors, tokenizer.json + tokenizer_config.json,
preprocessor_config.json, the chat template and, where the processor has settings of its own,
processor_config.json. The tokenizer is byte-level BPE without merges (every text encodes,
one token per byte) plus the architecture's special tokens, so nothing is downloaded.
Weights are drawn wide enough (initializer_range) that greedy answers vary with the image.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
          "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
          "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3.5's shape: thinking unless the caller sets enable_thinking to false.
QWEN35_CHAT = CHATML.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
IDEFICS3_CHAT = ("<|begin_of_text|>{% for m in messages %}{{ m['role'] | capitalize }}:{% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
LLAVA_CHAT = ("{% for m in messages %}{{ m['role'] | upper }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
              "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
              "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# Gemma 4's turn markers; the processor expands <|image|> into <|image> + soft tokens + <image|>.
GEMMA4_CHAT = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
               "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}"
               "{% endfor %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def byte_tokenizer(specials: list[str], added: list[str] = (), **special_roles: str):
    """A PreTrainedTokenizerFast: 256 byte tokens, then `specials` (special), then `added` (plain)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    raw.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=raw, **special_roles)


def _save(dest: Path, model, tokenizer, image_processor, chat_template: str | None,
          processor_config: dict | None = None, shard: str | None = None) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        (dest / "chat_template.jinja").write_text(chat_template)
    tokenizer.save_pretrained(dest)
    image_processor.save_pretrained(dest)
    if processor_config is not None:
        (dest / "processor_config.json").write_text(json.dumps(processor_config, indent=2))
    return dest


def _generation(model, eos: int, pad: int, **extra) -> None:
    g = model.generation_config
    g.eos_token_id, g.pad_token_id, g.bos_token_id = eos, pad, extra.pop("bos", None)
    for k, v in extra.items():
        setattr(g, k, v)


def _text(vocab: int, ids: dict[str, int], **kw) -> dict:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3, **ids, **kw)


def _build(config, seed: int):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config).eval()


def _redraw(model, seed: int, gain: float) -> None:
    """Weights drawn again, wide (gain / sqrt(fan_in)), for models whose own initialization leaves
    the answer independent of the image (Florence-2's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.1 * t if name.endswith("weight") else 0.05 * t)
            else:
                p.copy_(t * gain / p[0].numel() ** 0.5)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def _qwen(dest: Path, config_cls, patch: int, text_extra: dict, vision: dict, seed: int, chat: str = CHATML) -> Path:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = byte_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIALS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    cfg = config_cls(
        text_config=_text(len(tok), {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}, **text_extra),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.3,
                           **vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    model = _build(cfg, seed)
    _generation(model, eos, pad)
    unit = patch * 2
    ip = Qwen2VLImageProcessorPil(min_pixels=(2 * unit) ** 2, max_pixels=(4 * unit) ** 2, patch_size=patch,
                                  merge_size=2, temporal_patch_size=2)
    return _save(dest, model, tok, ip, chat)


def qwen2_5_vl(dest: Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig

    return _qwen(dest, Qwen2_5_VLConfig, 14, {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
                 {"window_size": 56, "fullatt_block_indexes": [1], "in_chans": 3}, seed)


def qwen3_vl(dest: Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLConfig

    return _qwen(dest, Qwen3VLConfig, 16,
                 {"head_dim": 8, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                                  "mrope_interleaved": True}},
                 {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1], "in_channels": 3}, seed)


def qwen3_vl_moe(dest: Path, seed: int = 0) -> Path:
    from transformers import Qwen3VLMoeConfig

    return _qwen(dest, Qwen3VLMoeConfig, 16,
                 {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}},
                 {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1], "in_channels": 3}, seed)


def qwen3_5(dest: Path, seed: int = 0) -> Path:
    """Both layer kinds (Gated DeltaNet, then gated full attention) and a thinking chat template."""
    from transformers import Qwen3_5Config

    return _qwen(dest, Qwen3_5Config, 16,
                 {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
                                      "partial_rotary_factor": 0.5}},
                 {"num_position_embeddings": 16, "in_channels": 3}, seed, QWEN35_CHAT)


def paligemma(dest: Path, seed: int = 0) -> Path:
    from transformers import PaliGemmaConfig
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    specials = ["<pad>", "<eos>", "<bos>", "<image>"]
    locs = [f"<loc{i:04d}>" for i in range(1024)]
    tok = byte_tokenizer(specials, locs, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                         extra_special_tokens={"image_token": "<image>"})
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    cfg = PaliGemmaConfig(
        text_config=dict(model_type="gemma", **_text(len(tok), {"eos_token_id": ids["<eos>"], "pad_token_id": ids["<pad>"],
                                                                "bos_token_id": ids["<bos>"]}, head_dim=8)),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_token_index=ids["<image>"], projection_dim=32, hidden_size=32, pad_token_id=ids["<pad>"])
    model = _build(cfg, seed)
    _generation(model, ids["<eos>"], ids["<pad>"], bos=ids["<bos>"])
    ip = SiglipImageProcessorPil(size={"height": 28, "width": 28}, image_seq_length=4)
    return _save(dest, model, tok, ip, None, {"processor_class": "PaliGemmaProcessor"})


def idefics3(dest: Path, seed: int = 0) -> Path:
    from transformers import Idefics3Config
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<end_of_utterance>", "<fake_token_around_image>",
                "<image>", "<global-img>"]
    tok = byte_tokenizer(specials, bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>",
                         pad_token="<|end_of_text|>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    eos, pad = ids["<end_of_utterance>"], ids["<|end_of_text|>"]
    cfg = Idefics3Config(
        text_config=dict(model_type="llama", **_text(len(tok), {"eos_token_id": eos, "pad_token_id": pad,
                                                                "bos_token_id": ids["<|begin_of_text|>"]})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=14, initializer_range=0.3),
        image_token_id=ids["<image>"], scale_factor=2, pad_token_id=pad, tie_word_embeddings=False)
    model = _build(cfg, seed)
    _generation(model, eos, pad)
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return _save(dest, model, tok, ip, IDEFICS3_CHAT, {"processor_class": "Idefics3Processor", "image_seq_len": 1})


def smolvlm(dest: Path, seed: int = 0) -> Path:
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    specials = ["<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                "<global-img>"]
    tok = byte_tokenizer(specials, bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    eos, pad = ids["<end_of_utterance>"], ids["<|im_end|>"]
    cfg = SmolVLMConfig(
        text_config=dict(model_type="llama", **_text(len(tok), {"eos_token_id": eos, "pad_token_id": pad,
                                                                "bos_token_id": ids["<|im_start|>"]})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=14, initializer_range=0.3),
        image_token_id=ids["<image>"], scale_factor=2, pad_token_id=pad, tie_word_embeddings=False)
    model = _build(cfg, seed)
    _generation(model, eos, pad)
    ip = SmolVLMImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return _save(dest, model, tok, ip, IDEFICS3_CHAT.replace("<|begin_of_text|>", "<|im_start|>"),
                 {"processor_class": "SmolVLMProcessor", "image_seq_len": 1})


def mistral3(dest: Path, seed: int = 0) -> Path:
    """Mistral3 (Pixtral vision): transformers' PixtralProcessor needs torchvision."""
    from transformers import Mistral3Config
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    specials = ["<unk>", "<s>", "</s>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>"]
    tok = byte_tokenizer(specials, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", **_text(len(tok), {"eos_token_id": ids["</s>"],
                                                                  "pad_token_id": ids["<pad>"],
                                                                  "bos_token_id": ids["<s>"]}, head_dim=8)),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14, head_dim=16),
        image_token_index=ids["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1)
    model = _build(cfg, seed)
    _generation(model, ids["</s>"], ids["<pad>"], bos=ids["<s>"])
    ip = PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=14)
    return _save(dest, model, tok, ip, LLAVA_CHAT.replace("<image>", "[IMG]"),
                 {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2})


def llava(dest: Path, seed: int = 0) -> Path:
    from transformers import LlavaConfig
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    specials = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
    tok = byte_tokenizer(specials, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                         extra_special_tokens={"image_token": "<image>"})
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    cfg = LlavaConfig(
        text_config=dict(model_type="llama", **_text(len(tok), {"eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"],
                                                                "bos_token_id": ids["<s>"]})),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        image_token_index=ids["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", pad_token_id=ids["<pad>"])
    model = _build(cfg, seed)
    _generation(model, ids["</s>"], ids["<pad>"], bos=ids["<s>"])
    ip = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return _save(dest, model, tok, ip, LLAVA_CHAT,
                 {"processor_class": "LlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
                  "num_additional_image_tokens": 1})


def gemma4(dest: Path, seed: int = 0) -> Path:
    """Gemma 4 (transformers 5.25): its processor takes a video processor by keyword and an audio
    feature extractor; the image processor's smallest budget is 70 soft tokens, here of 3x3 pooled
    4-pixel patches (images of about 84 x 84)."""
    from transformers import Gemma4Config
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    specials = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>", "<|audio>",
                "<|audio|>", "<audio|>", "<|video|>"]
    # Gemma4Processor reads the image and audio markers from the tokenizer (it refuses text
    # without the audio ones even for images).
    roles = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tok = byte_tokenizer(specials, bos_token="<bos>", eos_token="<turn|>", pad_token="<pad>", extra_special_tokens=roles)
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    eos, pad = ids["<turn|>"], ids["<pad>"]
    cfg = Gemma4Config(
        text_config=_text(len(tok), {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": ids["<bos>"]},
                          head_dim=8, global_head_dim=8, vocab_size_per_layer_input=len(tok),
                          hidden_size_per_layer_input=8, sliding_window=16, layer_types=["sliding_attention",
                                                                                         "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                           position_embedding_size=256, initializer_range=0.3),
        audio_config=None, boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"], audio_token_id=ids["<|audio|>"], tie_word_embeddings=False)
    model = _build(cfg, seed)
    _generation(model, eos, pad, bos=ids["<bos>"])
    ip = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    return _save(dest, model, tok, ip, GEMMA4_CHAT, {"processor_class": "Gemma4Processor", "image_seq_length": 70})


BUILDERS = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "qwen3_vl_moe": qwen3_vl_moe, "qwen3_5": qwen3_5,
            "paligemma": paligemma, "idefics3": idefics3, "smolvlm": smolvlm, "llava": llava,
            "gemma4": gemma4}


FLORENCE2_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<image>"]


def florence2_tokenizer():
    """BART's special tokens, then Florence-2's added (not special) ones: the 1000 <loc_N> and the region markers."""
    added = [f"<loc_{i}>" for i in range(1000)] + ["<od>", "</od>", "<poly>", "</poly>", "<sep>"]
    return byte_tokenizer(FLORENCE2_SPECIALS, added, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                          unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})


def florence2(dest: Path, seed: int = 0, text: dict | None = None, vision: dict | None = None, side: int = 64,
              generation: dict | None = None, shard: str | None = None) -> Path:
    """`text` / `vision` override the tiny BART / DaViT settings; `side`: the square input size;
    `generation`: extra generation_config settings; `shard`: max_shard_size (sharded weights)."""
    from transformers import Florence2Config
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = florence2_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in FLORENCE2_SPECIALS}
    text = dict(model_type="bart", vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                max_position_embeddings=256, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                pad_token_id=ids["<pad>"], decoder_start_token_id=ids["</s>"],
                forced_eos_token_id=ids["</s>"]) | (text or {})
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[1, 2], num_groups=[1, 2],
                  window_size=2, projection_dim=text["d_model"], max_position_embeddings=8, max_temporal_embeddings=4,
                  drop_path_rate=0.0) | (vision or {})
    cfg = Florence2Config(text_config=text, vision_config=vision, image_token_id=ids["<image>"])
    model = _build(cfg, seed)
    _redraw(model, seed, 2.0)
    _generation(model, ids["</s>"], ids["<pad>"], bos=ids["<s>"], decoder_start_token_id=ids["</s>"],
                **(generation or {}))
    cells = side
    for conv in model.model.vision_tower.convs:
        cells = (cells + 2 * conv.padding - conv.patch_size) // conv.stride + 1
    ip = CLIPImageProcessorPil(size={"height": side, "width": side}, crop_size={"height": side, "width": side},
                               do_center_crop=False, image_seq_length=1 + cells * cells)
    return _save(dest, model, tok, ip, None, {"processor_class": "Florence2Processor"}, shard)


BUILDERS["florence2"] = florence2
