"""Vision tower: uint8 images of any (multiple-of-32) size -> text-width features per image.

Token order (the merge order): patches are laid out in 2x2 merge blocks, blocks in raster order
over the merged grid, the four patches of a block in raster order inside it. Four consecutive
patches are one text token, so the merger's reshape is a plain view, and text token k of an
image sits at merged-grid cell (k // merged_w, k % merged_w).

Per image: normalize through the preprocessor's lookup table, patchify, embed (the Conv3d over
two identical temporal slots equals one linear map with the two slots' weights summed), add the
learned position table bilinearly resampled (align_corners) to the image's patch grid, then
`depth` LayerNorm blocks with 2-D rotary and full attention within the image, and the merger
(LayerNorm, 2x2 concat, 2-layer MLP). DeepStack: the outputs of the layers in
`deepstack_layers` go through their own mergers (LayerNorm after the concat); in layer order,
the k-th is added to the text hidden states at the image's tokens after text layer k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.hub import embedding_table
from .config import VisionConfig
from .rotary import apply_rotary, inverse_frequencies, vision_cos_sin


@dataclass
class DeepStack:
    """DeepStack features in a text forward: added to the image-token rows after text layers 0, 1, ..."""

    rows: torch.Tensor  # [M] long: flat rows of the forward that are image tokens
    features: list[torch.Tensor]  # [M, C] per text layer 0, 1, ...


@dataclass
class VisionOutput:
    features_TC: torch.Tensor  # [sum of image tokens, text dim], images concatenated in order
    deepstack: list[torch.Tensor]  # one [sum of image tokens, text dim] per deepstack layer
    tokens: list[int]  # image tokens per image


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Conv3d(c.in_channels, c.dim, (c.temporal_patch, c.patch_size, c.patch_size),
                              stride=(c.temporal_patch, c.patch_size, c.patch_size))

    def forward(self, patches_NK: torch.Tensor) -> torch.Tensor:
        """[N, C * p * p] one temporal slot's pixels -> [N, dim]."""
        w = self.proj.weight.sum(dim=2).flatten(1)  # a still image fills every temporal slot
        return F.linear(patches_NK, w, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.n_heads = c.n_heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x_NC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        N, C = x_NC.shape
        q, k, v = self.qkv(x_NC).view(N, 3, self.n_heads, C // self.n_heads).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = layout.attend(q, k, v)
        return self.proj(o.reshape(N, C))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(c.dim, c.ff_dim)
        self.linear_fc2 = nn.Linear(c.ff_dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.dim, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x_NC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        x_NC = x_NC + self.attn(self.norm1(x_NC), cos, sin, layout)
        return x_NC + self.mlp(self.norm2(x_NC))


class PatchMerger(nn.Module):
    """merge x merge patches -> one text token. The final merger norms each patch before the
    concat; the DeepStack mergers norm the concatenated vector."""

    def __init__(self, c: VisionConfig, norm_after_concat: bool):
        super().__init__()
        self.width = c.dim * c.merge**2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.width if norm_after_concat else c.dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_dim)

    def forward(self, x_NC: torch.Tensor) -> torch.Tensor:
        x = self.norm(x_NC.view(-1, self.width)) if self.norm_after_concat else self.norm(x_NC).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PaddedLayout:
    """Attention within each image of a flat patch batch: images padded to the longest, one
    batched call with a key mask (padding keys are masked; padding queries are dropped). Built
    on the host from the lengths and uploaded once per batch, without waiting: every vision layer
    reuses it, and no step needs a data-dependent shape."""

    def __init__(self, lengths: list[int], device: torch.device):
        B, L = len(lengths), max(lengths)
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        j = np.arange(L)
        valid_BL = j[None] < lens[:, None]
        rows_BL = np.where(valid_BL, starts[:, None] + j[None], 0)
        packed = np.concatenate([rows_BL.reshape(-1), np.flatnonzero(valid_BL), valid_BL.reshape(-1)])
        host = torch.from_numpy(packed)
        up = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        self.rows_BL = up[: B * L].view(B, L)
        self.flat = up[B * L : B * L + int(lens.sum())]  # [n patches] rows of the real queries in [B * L]
        self.mask = None if min(lengths) == L else up[-B * L :].view(B, L).bool()[:, None, None, :]
        self.single = B == 1

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
        if self.single:
            o = F.scaled_dot_product_attention(q_NHD.transpose(0, 1), k_NHD.transpose(0, 1), v_NHD.transpose(0, 1))
            return o.transpose(0, 1)
        q, k, v = (t[self.rows_BL].transpose(1, 2) for t in (q_NHD, k_NHD, v_NHD))  # [B, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        B, H, L, D = o.shape
        return o.transpose(1, 2).reshape(B * L, H, D).index_select(0, self.flat)


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = embedding_table(c.n_pos_embeddings, c.dim)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(c, norm_after_concat=True)
                                                   for _ in c.deepstack_layers)
        self.register_buffer("lut", torch.zeros(3, 256), persistent=False)
        self.register_buffer("inv_freq", inverse_frequencies(c.head_dim // 2, c.rope_theta), persistent=False)

    def reset_buffers(self, lut: torch.Tensor) -> None:
        """Set the normalization table (float32 [3, 256]) and recompute the rotary frequencies."""
        dev = self.pos_embed.weight.device
        self.lut = lut.to(dev, torch.float32)
        self.inv_freq = inverse_frequencies(self.config.head_dim // 2, self.config.rope_theta).to(dev)

    def patches(self, image_HW3: torch.Tensor) -> torch.Tensor:
        """uint8 [H, W, 3] -> normalized patches [N, 3 * p * p] (float32) in the merge order,
        each row in (channel, row, col) order: one temporal slot of the processor's rows."""
        c = self.config
        p, m = c.patch_size, c.merge
        H, W, _ = image_HW3.shape
        x_3HW = self.lut.gather(1, image_HW3.permute(2, 0, 1).reshape(3, -1).long()).view(3, H, W)
        x = x_3HW.view(3, H // (p * m), m, p, W // (p * m), m, p)
        # -> [block row, block col, row in block, col in block, channel, pixel row, pixel col]
        return x.permute(1, 4, 2, 5, 0, 3, 6).reshape(-1, 3 * p * p)

    def _grid_tables(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position embeddings [N, dim] and patch rows, cols [N], in the merge order."""
        c = self.config
        dev = self.pos_embed.weight.device
        side = c.pos_side
        table = self.pos_embed.weight.view(side, side, -1)

        def taps(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # align_corners: output 0 and n-1 land on table rows 0 and side-1.
            src = torch.arange(n, device=dev, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long()
            return lo, (lo + 1).clamp_max(side - 1), frac

        h0, h1, fh = taps(gh)
        w0, w1, fw = taps(gw)
        rows = table[h0] * (1 - fh)[:, None, None] + table[h1] * fh[:, None, None]  # [gh, side, dim]
        grid = rows[:, w0] * (1 - fw)[None, :, None] + rows[:, w1] * fw[None, :, None]  # [gh, gw, dim]
        m = c.merge
        r = torch.arange(gh, device=dev)[:, None].expand(gh, gw)
        q = torch.arange(gw, device=dev)[None, :].expand(gh, gw)

        def merge_order(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(gh // m, m, gw // m, m, *t.shape[2:])
            return t.transpose(1, 2).reshape(gh * gw, *t.shape[4:])

        return merge_order(grid), merge_order(r), merge_order(q)

    def forward(self, images: list[torch.Tensor], keeps: list[torch.Tensor | None] | None = None) -> VisionOutput:
        """uint8 images [H, W, 3] on the device -> their text-width features. `keeps[i]`
        (duplicate pruning, base/prune.py): image i's kept merge groups (long, on the device); only
        their patches are encoded, each with its own position embedding and rotary position on
        the full grid, and attention runs among them alone."""
        c = self.config
        dtype = self.pos_embed.weight.dtype
        embeds, pos, rows, cols, lengths = [], [], [], [], []
        for im, keep in zip(images, keeps or [None] * len(images)):
            gh, gw = im.shape[0] // c.patch_size, im.shape[1] // c.patch_size
            tables = (self.patches(im), *self._grid_tables(gh, gw))
            if keep is not None:  # a group's m * m patches are consecutive rows (the merge order)
                at = (keep[:, None] * c.merge**2 + torch.arange(c.merge**2, device=keep.device)).reshape(-1)
                tables = tuple(t.index_select(0, at) for t in tables)
            patches, pe, r, q = tables
            embeds.append(patches)
            pos.append(pe)
            rows.append(r)
            cols.append(q)
            lengths.append(patches.shape[0])
        x = self.patch_embed(torch.cat(embeds).to(dtype)) + torch.cat(pos).to(dtype)
        cos, sin = vision_cos_sin(torch.cat(rows), torch.cat(cols), self.inv_freq)
        layout = PaddedLayout(lengths, x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout)
            if i in c.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[c.deepstack_layers.index(i)](x))
        return VisionOutput(self.merger(x), deepstack, [n // c.merge**2 for n in lengths])
