"""Texts as transformers' SigLIP processors and zero-shot pipeline give them to the text tower:
the checkpoint's tokenizer.json (its normalizer, its post-processor: the EOS it appends; transformers
keeps it whatever tokenizer_config.json's add_bos_token / add_eos_token say, tested), lower-cased
first for SigLIP 2 (transformers' Siglip2Tokenizer puts Lowercase before the normalizer), truncated
and padded to 64 tokens (padding="max_length", max_length=64, truncation=True), on the side
tokenizer_config.json names (Siglip2Tokenizer's default: left), with the attention mask.
Runs in the main process: a classify task's texts once per job, a similarity task's per batch."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..base.errors import ConfigError

MAX_LENGTH = 64  # Siglip2Processor's text max_length, and the zero-shot pipeline's for SigLIP


class TextPrep:
    def __init__(self, folder: Path, lowercase: bool, max_positions: int):
        from tokenizers import Tokenizer, normalizers

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json (classify and similarity tasks read text; embed does not)")
        tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        if lowercase and tok.normalizer is not None:
            tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), tok.normalizer])
        if MAX_LENGTH > max_positions:
            raise ConfigError(f"{folder}: the text tower has {max_positions} positions, fewer than the "
                              f"{MAX_LENGTH} tokens transformers pads texts to")
        pad = _content(cfg.get("pad_token", "<pad>"))
        pad_id = tok.token_to_id(pad)
        if pad_id is None:
            raise ConfigError(f"{folder}: the pad token {pad!r} is not in tokenizer.json")
        side = cfg.get("padding_side", "left" if lowercase else "right")
        tok.enable_truncation(MAX_LENGTH)
        tok.enable_padding(direction=side, pad_id=pad_id, pad_token=pad, length=MAX_LENGTH)
        self.tok = tok

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids, attention mask), both [len(texts), 64] int64."""
        enc = self.tok.encode_batch(texts)
        return (torch.tensor([e.ids for e in enc], dtype=torch.long),
                torch.tensor([e.attention_mask for e in enc], dtype=torch.long))


def _content(token) -> str | None:
    """A tokenizer_config.json special token: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token
