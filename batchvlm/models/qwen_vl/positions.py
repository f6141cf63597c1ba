"""Rotary positions of an image prefix and of the text after it (transformers' get_rope_index
for one image).

A sequence is [head text (s tokens)][image: gh x gw merged tokens][vision_end, task text, ...].
Head text token i has position (i, i, i). Image token k at merged cell (r, c) = divmod(k, gw)
has (t, h, w) = (s, s + r, s + c). Text after the image resumes at s + max(gh, gw), one
position per token, all three axes equal. With duplicate pruning (base/prune.py) only the kept
cells' tokens are in the prefix, each with its position above; vision_end and the text after it
keep theirs.

So positions are not KV slots: the prefix occupies s + n + 1 slots (n image tokens: gh * gw,
fewer when pruned) but ends at position s + max(gh, gw) (the vision_end token), and every later
token's position is its slot index plus `delta = max(gh, gw) - n` (<= 0 unless pruning left
fewer tokens than a side of the grid). The engine keeps a per-sequence next position beside its
slot count; decode positions are 1-D (t = h = w).
"""

from __future__ import annotations

import torch


def prefix_positions(head_len: int, grid: tuple[int, int], device: torch.device | None = None,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """[3, head_len + image tokens + 1] long: the head text, the image tokens and vision_end.
    `keep` (duplicate pruning): the kept cells, each at its own place on the full grid."""
    gh, gw = grid
    head = torch.arange(head_len, device=device).expand(3, head_len)
    k = torch.arange(gh * gw, device=device) if keep is None else keep.to(device)
    image = torch.stack([torch.zeros_like(k), k // gw, k % gw]) + head_len
    end = torch.full((3, 1), head_len + max(gh, gw), device=device)
    return torch.cat([head, image, end], dim=1)


def next_position(head_len: int, grid: tuple[int, int]) -> int:
    """Position of the first token after the prefix (after vision_end)."""
    return head_len + max(grid) + 1
