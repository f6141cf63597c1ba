"""The Florence-2 module tree. Parameter names are the checkpoint's: `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*` (`lm_head.weight`, tied to the shared
embedding, is not a parameter here).

Three stages, each reusable on its own (the engine caches the first per image, the second per
(image, prompt)):
  image_tokens  uint8 pixels -> image tokens [B, 1 + cells, C]            per image
  encode        [image tokens | prompt embeddings] -> encoder output      per (image, prompt)
  decoder       own tokens, self-attention + cross-attention to that output
`dense_logits` runs the decoder over whole token sequences (teacher forcing), the reference
path the parity tests compare with transformers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.layers import Towers
from .config import Florence2Config
from .language import LanguageModel
from .preprocess import normalize
from .vision import DaViT, Projector


class Florence2Model(nn.Module):
    def __init__(self, config: Florence2Config):
        super().__init__()
        self.config = config
        self.model = Towers(vision_tower=DaViT(config.vision), multi_modal_projector=Projector(config.vision),
                            language_model=LanguageModel(config.text))
        self.register_buffer("lut", torch.zeros(3, 256), persistent=False)  # uint8 level -> pixel value

    @property
    def text(self) -> LanguageModel:
        return self.model.language_model

    @property
    def device(self) -> torch.device:
        return self.text.shared.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.shared.weight.dtype

    def pixel_values(self, pixels_BHW3: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] (any device) -> float32 [B, 3, H, W], the processor's values."""
        return normalize(pixels_BHW3, self.lut)

    def image_tokens(self, pixel_values_B3HW: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, 1 + (H / stride) * (W / stride), C] in the model's dtype."""
        cells = self.model.vision_tower(pixel_values_B3HW.to(self.dtype))
        return self.model.multi_modal_projector(cells)

    def encode(self, image_BIC: torch.Tensor, prompt_BP: torch.Tensor, valid_BP: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder output [B, I + P, C] over [image tokens | prompt tokens]. `valid_BP`: False
        where a prompt is padded (the image tokens are always valid)."""
        embeds = torch.cat([image_BIC, self.text.embed(prompt_BP)], dim=1)
        valid = None
        if valid_BP is not None:
            valid = torch.cat([valid_BP.new_ones(image_BIC.shape[:2]), valid_BP], dim=1)
        return self.text.encoder(embeds, valid)

    def dense_logits(self, tokens_BS: torch.Tensor, enc_BTC: torch.Tensor,
                     enc_valid_BT: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [B, S, V] of every decoder position, tokens_BS starting with the decoder
        start token: causal self-attention, cross-attention to the whole encoder output."""
        cross = [layer.cross_kv(enc_BTC) for layer in self.text.decoder.layers]  # [B, T, H, D] each
        mask = None if enc_valid_BT is None else enc_valid_BT[:, None, None, :]

        def self_attend(_layer: int, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

        def cross_attend(layer: int, q):
            k, v = cross[layer]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
            return out.transpose(1, 2)

        pos = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
        hidden = self.text.decoder(self.text.embed(tokens_BS), pos, self_attend, cross_attend)
        return self.text.logits(hidden)
