"""Tiny random SigLIP checkpoints built by transformers, saved in the hub layout: SigLIP 2 NaFlex
(`siglip2`: Siglip2Tokenizer, which lower-cases; EOS appended, right padding) and a
fixed-resolution `siglip` (a plain BPE tokenizer.json with an EOS template). Texts encode one
token per character, so nothing is downloaded. The logit scale and bias are set so that choice
probabilities differ visibly."""

from __future__ import annotations

import math
import string
from pathlib import Path

import numpy as np
import torch
from PIL import Image

CHARS = string.ascii_letters + string.digits + ".,{}'!?- "
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _vocab(lower: bool) -> dict[str, int]:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "▁": 5}
    for c in (CHARS.lower() if lower else CHARS).replace(" ", ""):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault("▁" + c, len(vocab))
    return vocab


def _widen(model, seed: int) -> None:
    """Random weights wide enough that embeddings vary with the image and the text."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.fill_(math.log(10.0))
            elif name.endswith("logit_bias"):
                p.fill_(-2.0)
            elif p.ndim >= 2 or "probe" in name:
                p.normal_(0, 0.2)
            elif name.endswith("bias") and "norm" not in name:
                p.normal_(0, 0.05)


def siglip2_checkpoint(dest: Path, seed: int = 0, max_patches: int = 24) -> Path:
    from transformers import Siglip2Config, Siglip2Model, Siglip2Processor, Siglip2Tokenizer
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    vocab = _vocab(lower=True)
    config = Siglip2Config(text_config=dict(TOWER, vocab_size=len(vocab), max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2),
                           vision_config=dict(TOWER, patch_size=4, num_patches=16))
    model = Siglip2Model(config).eval()
    _widen(model, seed)
    tok = Siglip2Tokenizer(vocab=vocab, merges=[], add_eos_token=True, padding_side="right")
    processor = Siglip2Processor(Siglip2ImageProcessorPil(patch_size=4, max_num_patches=max_patches), tok)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    processor.save_pretrained(dest)
    return dest


def siglip_checkpoint(dest: Path, seed: int = 1) -> Path:
    """Fixed resolution (24 x 24, patch 4): the SigLIP 2 FixRes / SigLIP layout."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, SiglipConfig, SiglipModel
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    vocab = _vocab(lower=False)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    raw.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = SiglipConfig(text_config=dict(TOWER, vocab_size=len(vocab), max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2),
                          vision_config=dict(TOWER, patch_size=4, image_size=24))
    model = SiglipModel(config).eval()
    _widen(model, seed)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    SiglipImageProcessorPil(size={"height": 24, "width": 24}).save_pretrained(dest)
    return dest


def random_images(n: int, seed: int = 0) -> list[Image.Image]:
    """Images of varied sizes and aspect ratios (NaFlex grids of several shapes)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(8, 90)), int(rng.integers(8, 90)), 3),
                                        dtype=np.uint8)) for _ in range(n)]
