"""DaViT, Florence-2's vision tower, and the projector that turns its last stage into image tokens.

A stage is a strided conv (LayerNorm before it, or after it for the first stage) then blocks of
two halves: a spatial half (depthwise conv, window self-attention over window x window cells,
depthwise conv, MLP) and a channel half (the same with attention between channel groups, each
channel attending over all cells). Every sub-layer is pre-norm with a residual; the depthwise
convs are residual too. Parameter names are the checkpoint's (`model.vision_tower.*`,
`model.multi_modal_projector.*`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import VisionConfig

CHUNK_VALUES = 1 << 18  # attention / MLP input values at once on the CPU: 1 MiB of float32


def chunks(n: int, values_each: int, device: torch.device) -> list[slice]:
    """Slices of n items (windows' bands, images, cells) of values_each input values each, about
    CHUNK_VALUES values a slice (a last slice under half that joins the one before), at least one
    item. On the CPU the attention and the MLP run a slice at a time, so their temporaries (qkv,
    the MLP's 4x hidden) are small enough for the allocator to reuse rather than fresh pages
    each call (every fresh page is a fault) and stay in cache. Each op is per window, image or
    cell, so the values are the whole batch's up to float32 rounding; bit for bit on one CPU
    thread (and on two with slices of 64 cells or more; CHUNK_VALUES gives 128 or more up to
    width 2048), as MKL takes another path for GEMMs of 1 to 3 rows, hence no short last slice.
    Elsewhere one slice."""
    per = max(1, CHUNK_VALUES // values_each) if device.type == "cpu" else n
    starts = list(range(0, n, per))
    if len(starts) > 1 and 2 * (n - starts[-1]) < per:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [n])]


class ConvEmbed(nn.Module):
    def __init__(self, c: VisionConfig, stage: int):
        super().__init__()
        cin = c.in_channels if stage == 0 else c.dims[stage - 1]
        self.pre_norm = c.patch_prenorm[stage]
        self.conv = nn.Conv2d(cin, c.dims[stage], c.patch_size[stage], c.patch_stride[stage], c.patch_padding[stage])
        self.norm = nn.LayerNorm(cin if self.pre_norm else c.dims[stage])

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x_BCHW = self.norm(x_BCHW.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x_BCHW = self.conv(x_BCHW)
        if not self.pre_norm:
            x_BCHW = self.norm(x_BCHW.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x_BCHW


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, int(dim * ratio))
        self.fc2 = nn.Linear(int(dim * ratio), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, bias: bool):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BHWC: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x_BHWC.shape
        w = self.window
        pad_h, pad_w = (w - H % w) % w, (w - W % w) % w
        # pad right / bottom to whole windows; padded cells are keys too (zeros), as upstream
        x = F.pad(x_BHWC, (0, 0, 0, pad_w, 0, pad_h)) if pad_h or pad_w else x_BHWC
        Hp, Wp = H + pad_h, W + pad_w
        # a band: w rows of cells, Wp / w windows side by side
        bands = x.view(B * Hp // w, w, Wp // w, w, C)
        out = torch.empty_like(bands)
        for sl in chunks(bands.shape[0], w * Wp * C, x.device):
            win_NTC = bands[sl].permute(0, 2, 1, 3, 4).reshape(-1, w * w, C)
            N, T = win_NTC.shape[:2]
            q, k, v = self.qkv(win_NTC).view(N, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            attn_NTC = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, T, C)
            out[sl] = self.proj(attn_NTC).view(-1, Wp // w, w, w, C).permute(0, 2, 1, 3, 4)
        out = out.view(B, Hp, Wp, C)
        return (out[:, :H, :W] if pad_h or pad_w else out).reshape(B, H * W, C)


class ChannelAttention(nn.Module):
    def __init__(self, dim: int, groups: int, bias: bool):
        super().__init__()
        self.groups = groups
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        out_BTC = x_BTC.new_empty(B, T, C)
        for sl in chunks(B, T * C, x_BTC.device):
            x = x_BTC[sl]
            # [3, b, groups, C / groups, T]: each channel is a query over the T cells
            b = x.shape[0]
            # [3, b, groups, T, C / groups]: each channel is a query over the T cells
            q, k, v = self.qkv(x).view(b, T, 3, self.groups, C // self.groups).permute(2, 0, 3, 1, 4)
            # Two matmuls around a [C / groups]^2 softmax. As SDPA this is attention with head_dim T
            # (36,864 cells at stage 0 of a 768 image): no fused kernel takes it, and the math
            # fallback copies q, k, v to float32 for half inputs. Scaled as that fallback scales
            # (q and k by the scale's root), so float32 values are SDPA's bit for bit.
            root = math.sqrt(T**-0.5)
            attn = ((q * root).transpose(-1, -2) @ (k * root)).softmax(-1)  # [b, groups, C / groups, C / groups]
            out = v @ attn.transpose(-1, -2)  # [b, groups, T, C / groups]
            out_BTC[sl] = self.proj(out.transpose(1, 2).reshape(b, T, C))
        return out_BTC


class HalfBlock(nn.Module):
    """conv1 + attention, conv2 + MLP; `spatial` picks window or channel attention."""

    def __init__(self, c: VisionConfig, stage: int, spatial: bool):
        super().__init__()
        dim = c.dims[stage]
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = nn.LayerNorm(dim)
        attn = (WindowAttention(dim, c.heads[stage], c.window, c.qkv_bias) if spatial
                else ChannelAttention(dim, c.groups[stage], c.qkv_bias))
        self.spatial = spatial
        setattr(self, "window_attn" if spatial else "channel_attn", attn)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = MLP(dim, c.mlp_ratio)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        x_BTC = self.conv1(x_BCHW).add_(x_BCHW).flatten(2).transpose(1, 2)
        h = self.norm1(x_BTC)
        h = self.window_attn(h.view(B, H, W, C)) if self.spatial else self.channel_attn(h)
        x_BCHW = h.add_(x_BTC).transpose(1, 2).reshape(B, C, H, W)
        x_BTC = self.conv2(x_BCHW).add_(x_BCHW).flatten(2).transpose(1, 2)
        x_MC = x_BTC.flatten(0, 1)  # [B * cells, C], a view when x_BTC is contiguous or B is 1
        for sl in chunks(x_MC.shape[0], C, x_MC.device):
            x_MC[sl] += self.ffn(self.norm2(x_MC[sl]))
        return x_MC.view(B, H * W, C).transpose(1, 2).reshape(B, C, H, W)


class Block(nn.Module):
    def __init__(self, c: VisionConfig, stage: int):
        super().__init__()
        self.spatial_block = HalfBlock(c, stage, spatial=True)
        self.channel_block = HalfBlock(c, stage, spatial=False)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.channel_block(self.spatial_block(x_BCHW))


class DaViT(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.convs = nn.ModuleList(ConvEmbed(c, s) for s in range(len(c.dims)))
        self.blocks = nn.ModuleList(nn.ModuleList(Block(c, s) for _ in range(c.depths[s])) for s in range(len(c.dims)))

    def forward(self, pixels_BCHW: torch.Tensor) -> torch.Tensor:
        x = pixels_BCHW
        for conv, stage in zip(self.convs, self.blocks):
            x = conv(x)
            for block in stage:
                x = block(x)
        return x  # [B, C, H / stride, W / stride]


class PositionEmbed2D(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        dim = c.dims[-1]
        self.row_embeddings = nn.Embedding(c.max_positions, dim // 2)
        self.column_embeddings = nn.Embedding(c.max_positions, dim - dim // 2)

    def forward(self, H: int, W: int) -> torch.Tensor:
        """[H * W, C]: a cell's column embedding, then its row embedding."""
        dev = self.row_embeddings.weight.device
        col_WC = self.column_embeddings(torch.arange(W, device=dev))
        row_HC = self.row_embeddings(torch.arange(H, device=dev))
        return torch.cat([col_WC[None].expand(H, -1, -1), row_HC[:, None].expand(-1, W, -1)], dim=-1).reshape(H * W, -1)


class TemporalEmbed(nn.Module):
    """The checkpoint's sinusoid table; one frame per image, so only row 0 is read."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.pos_idx_to_embed = nn.Parameter(torch.empty(c.max_temporal, c.dims[-1]), requires_grad=False)


class Projector(nn.Module):
    """Last DaViT stage [B, C, H, W] -> image tokens [B, 1 + H * W, text width]: cells plus 2-D
    position and frame-0 temporal embeddings; token 0 is their mean over the cells (spatial
    pooling), tokens 1.. the cells themselves (temporal pooling over the single frame)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.image_projection = nn.Linear(c.dims[-1], c.projection_dim, bias=False)
        self.image_proj_norm = nn.LayerNorm(c.projection_dim)
        self.image_position_embed = PositionEmbed2D(c)
        self.visual_temporal_embed = TemporalEmbed(c)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BCHW.shape
        x_BTC = x_BCHW.flatten(2).transpose(1, 2) + self.image_position_embed(H, W)
        x_BTC = x_BTC + self.visual_temporal_embed.pos_idx_to_embed[0]
        tokens_BTC = torch.cat([x_BTC.mean(dim=1, keepdim=True), x_BTC], dim=1)
        return self.image_proj_norm(self.image_projection(tokens_BTC))
