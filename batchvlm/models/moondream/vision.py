"""Vision tower: SigLIP-style ViT over all crops of many images, crop fusion, projection.

Every image becomes exactly `grid**2` tokens for the text model: the global crop's features
concatenated channel-wise with the local crops' features stitched into one grid and
average-pooled back to grid x grid.

Duplicate pruning (model.prune_duplicates, base/prune.py; `forward_kept`): token t is dropped
when patch t of the global crop repeats a kept neighbour. The global crop is then encoded on its
kept patches alone (each with its own learned position embedding, attending among themselves);
the local crops are encoded whole, because their features are stitched and pooled over the full
grid, and only the pooled rows of the kept tokens are used. Attention runs within each crop, the
crops of one length batched together (CropGroups): a crop's result does not depend on the other
images of the batch, so labels are the same at every batch size. A 1 x 1 tiling (every image up to
about one crop in size) has no local crops: all its dropped patches skip the tower.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import VisionConfig
from .layers import MLP, Attention


class CropGroups:
    """Attention within each crop of a flat batch of crops of different lengths: the crops of one
    length are one dense call (as the whole-crop path's), so no crop is padded and no crop's
    result depends on which other crops share the batch."""

    def __init__(self, lengths: list[int], device: torch.device):
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        self.rows = [torch.from_numpy(starts[lens == n][:, None] + np.arange(n)[None]).to(device, non_blocking=True)
                     for n in np.unique(lens).tolist()]  # [crops of length n, n] flat rows each

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q_NHD)
        for rows in self.rows:
            o = F.scaled_dot_product_attention(*(t[rows].transpose(1, 2) for t in (q_NHD, k_NHD, v_NHD)))
            out[rows.reshape(-1)] = o.transpose(1, 2).reshape(-1, *q_NHD.shape[1:])
        return out


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.enc_dim)
        self.attn = Attention(c.enc_dim, 3 * c.enc_dim)
        self.ln2 = nn.LayerNorm(c.enc_dim)
        self.mlp = MLP(c.enc_dim, c.enc_ff_dim)
        self.n_heads = c.enc_n_heads

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.attn.qkv(self.ln1(x_BTC)).view(B, T, 3, self.n_heads, C // self.n_heads).unbind(2)
        out_BHTD = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x_BTC = x_BTC + self.attn.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))
        return x_BTC + self.mlp(self.ln2(x_BTC))

    def forward_flat(self, x_NC: torch.Tensor, layout: CropGroups) -> torch.Tensor:
        """The same block on a flat batch of crops of different lengths (attention within each)."""
        N, C = x_NC.shape
        q, k, v = self.attn.qkv(self.ln1(x_NC)).view(N, 3, self.n_heads, C // self.n_heads).unbind(1)
        x_NC = x_NC + self.attn.proj(layout.attend(q, k, v).reshape(N, C))
        return x_NC + self.mlp(self.ln2(x_NC))


class VisionModel(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        patch_dim = c.enc_patch_size * c.enc_patch_size * c.in_channels
        self.patch_emb = nn.Linear(patch_dim, c.enc_dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, c.n_image_tokens, c.enc_dim))
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.enc_n_layers))
        self.post_ln = nn.LayerNorm(c.enc_dim)
        self.proj_mlp = MLP(2 * c.enc_dim, c.proj_inner_dim, c.proj_out_dim)

    def patches(self, crops_NHWC: torch.Tensor) -> torch.Tensor:
        """uint8 crops -> normalized patch vectors [N, grid*grid, C*p*p]. Normalizes on the device."""
        c = self.config
        p, g = c.enc_patch_size, c.grid
        x = crops_NHWC.to(self.pos_emb.dtype).permute(0, 3, 1, 2)
        x = x.div(255.0).sub_(0.5).div_(0.5)
        N = x.shape[0]
        # [N, C, g, p, g, p] -> [N, g, g, C, p, p]: patch vectors in (channel, row, col) order.
        patches = x.reshape(N, c.in_channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(N, g * g, c.in_channels * p * p)

    def encode_crops(self, crops_NHWC: torch.Tensor) -> torch.Tensor:
        """uint8 crops -> encoder features [N, grid*grid, enc_dim]."""
        h = self.patch_emb(self.patches(crops_NHWC)) + self.pos_emb
        for block in self.blocks:
            h = block(h)
        return self.post_ln(h)

    def encode_kept(self, crops_NHWC: torch.Tensor, keeps: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """uint8 crops -> encoder features of each crop's kept patches [n_kept, enc_dim];
        `keeps[n]`: crop n's kept patches (long, raster order, on the device), None: all."""
        T = self.config.n_image_tokens
        patches = self.patches(crops_NHWC).flatten(0, 1)
        every = torch.arange(T, device=patches.device)
        rows = torch.cat([n * T + (every if keep is None else keep) for n, keep in enumerate(keeps)])
        h = self.patch_emb(patches.index_select(0, rows)) + self.pos_emb[0].index_select(0, rows % T)
        lengths = [T if keep is None else keep.numel() for keep in keeps]
        layout = CropGroups(lengths, h.device)
        for block in self.blocks:
            h = block.forward_flat(h, layout)
        return list(self.post_ln(h).split(lengths))

    def stitch_and_pool(self, local_NggC: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Local crop features -> one grid with the overlaps dropped -> pooled [grid*grid, C].

        Each crop keeps its centre (g - 2m) x (g - 2m) patches; crops on the image border also
        keep their outer margin, so the stitched grid is (rows*(g-2m) + 2m) x (cols*(g-2m) + 2m).
        """
        c = self.config
        g, m = c.grid, c.overlap_margin
        rows, cols = tiling
        w = g - 2 * m
        stitched = local_NggC.new_empty(rows * w + 2 * m, cols * w + 2 * m, local_NggC.shape[-1])
        for i in range(rows):
            for j in range(cols):
                y0 = 0 if i == 0 else m
                y1 = g if i == rows - 1 else g - m
                x0 = 0 if j == 0 else m
                x1 = g if j == cols - 1 else g - m
                stitched[i * w + y0 : i * w + y1, j * w + x0 : j * w + x1] = local_NggC[i * cols + j, y0:y1, x0:x1]
        pooled_CHW = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g))
        return pooled_CHW.permute(1, 2, 0).reshape(g * g, -1)

    def forward(self, crops_NHWC: torch.Tensor, tilings: list[tuple[int, int]]) -> torch.Tensor:
        """All crops of several images (concatenated in image order) -> [n_images, grid*grid, proj_out_dim].

        An image with a 1x1 tiling ships only its global crop: its one local crop would be the
        identical resize, and pooling a grid x grid map to grid x grid is the identity, so its
        local features equal its global features.
        """
        g = self.config.grid
        feats_NTC = self.encode_crops(crops_NHWC)
        fused, start = [], 0
        for tiling in tilings:
            global_TC = feats_NTC[start]
            n_local = tiling[0] * tiling[1]
            if n_local == 1:
                local_TC, start = global_TC, start + 1
            else:
                local = feats_NTC[start + 1 : start + 1 + n_local].view(n_local, g, g, -1)
                local_TC, start = self.stitch_and_pool(local, tiling), start + 1 + n_local
            fused.append(torch.cat([global_TC, local_TC], dim=-1))
        if start != feats_NTC.shape[0]:
            raise ValueError(f"crops ({feats_NTC.shape[0]}) do not match tilings ({start})")
        return self.proj_mlp(torch.stack(fused))

    def forward_kept(self, crops_NHWC: torch.Tensor, tilings: list[tuple[int, int]],
                     keeps: list[torch.Tensor]) -> list[torch.Tensor]:
        """`forward` with duplicate pruning: `keeps[i]` is image i's kept tokens (long, raster
        order over the grid, on the device) -> image i's kept tokens [n_kept, proj_out_dim]."""
        g = self.config.grid
        crop_keeps: list[torch.Tensor | None] = []
        for tiling, keep in zip(tilings, keeps):
            crop_keeps += [keep] + [None] * (n_crops(tiling) - 1)
        feats = self.encode_kept(crops_NHWC, crop_keeps)
        fused, start = [], 0
        for tiling, keep in zip(tilings, keeps):
            global_TC, n_local = feats[start], tiling[0] * tiling[1]
            if n_local == 1:
                local_TC, start = global_TC, start + 1
            else:
                local = torch.stack(feats[start + 1 : start + 1 + n_local]).view(n_local, g, g, -1)
                local_TC, start = self.stitch_and_pool(local, tiling).index_select(0, keep), start + 1 + n_local
            fused.append(torch.cat([global_TC, local_TC], dim=-1))
        if start != len(feats):
            raise ValueError(f"crops ({len(feats)}) do not match tilings ({start})")
        return list(self.proj_mlp(torch.cat(fused)).split([f.shape[0] for f in fused]))


def n_crops(tiling: tuple[int, int]) -> int:
    """Crops shipped for an image with this tiling (see VisionModel.forward)."""
    return 1 if tiling == (1, 1) else 1 + tiling[0] * tiling[1]
