"""Simple batched generation: a static batch of images x sequences, one host sync per step.

This is the straightforward way to batch Moondream: encode all images, prefill every image
prefix once, prefill every task prompt against its image's shared prefix, then step all
unfinished sequences together until none is left. It is the reference the engine
(batchvlm/engine) must match label for label, and a baseline in scripts/bench_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention import AttentionBatch, AttentionGroup, PAD_POS, logical_len, slots_of
from .decoding import MODE_DETECT, MODE_POINT, MODE_TEXT, RawOutput, RowState, apply_decision, decide
from .model import MoondreamModel
from .preprocess import PreparedImage


@dataclass(frozen=True)
class SeqSpec:
    """One sequence to run on an image: a caption, a query, or one object of point / detect."""

    mode: int  # MODE_TEXT | MODE_POINT | MODE_DETECT
    prompt: tuple[int, ...]
    limit: int  # max_new_tokens (text) or max_objects (spatial)
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def budget(self) -> int:
        """Positions the sequence may write after its prompt (an upper bound)."""
        per_step = {MODE_TEXT: 1, MODE_POINT: 2, MODE_DETECT: 3}[self.mode]
        return per_step * self.limit


def encode_images(model: MoondreamModel, images: list[PreparedImage]) -> torch.Tensor:
    """Vision stage for a batch of images -> [I, grid*grid, C]."""
    crops = torch.from_numpy(np.concatenate([im.crops for im in images])).to(model.device)
    return model.vision(crops, [im.tiling for im in images])


@torch.inference_mode()
def generate(
    model: MoondreamModel,
    images: list[PreparedImage],
    specs: list[SeqSpec],
    seeds: list[list[int]] | None = None,
    block_size: int = 16,
) -> list[list[RawOutput]]:
    """Run every spec on every image -> outputs[image][spec]. `seeds[image][spec]` seeds sampling."""
    dev = model.device
    P = model.config.prefix_len
    bs = block_size
    n_prefix_blocks = -(-P // bs)
    P_pad = n_prefix_blocks * bs
    I, S = len(images), len(specs)
    rows = [(i, s) for i in range(I) for s in range(S)]
    own_blocks = [-(-(len(sp.prompt) + sp.budget) // bs) for sp in specs]
    cache = model.new_kv_cache(1 + I * n_prefix_blocks + I * sum(own_blocks), bs)

    def prefix_table(i: int) -> list[int]:
        return list(range(1 + i * n_prefix_blocks, 1 + (i + 1) * n_prefix_blocks))

    next_block = 1 + I * n_prefix_blocks
    tables = []
    for i, s in rows:
        tables.append(prefix_table(i) + list(range(next_block, next_block + own_blocks[s])))
        next_block += own_blocks[s]
    width = max(map(len, tables))
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)

    # 1. Vision, then every image prefix once: a bidirectional P-token prefill per image.
    prefix_t = torch.tensor([prefix_table(i) for i in range(I)], dtype=torch.long, device=dev)
    pos_IP = torch.arange(P, device=dev).expand(I, P)
    batch = AttentionBatch(
        write_slots=slots_of(prefix_t, pos_IP, bs, P).reshape(-1),
        groups=[AttentionGroup(torch.arange(I * P, device=dev).view(I, P), pos_IP, prefix_t,
                               torch.full((I,), P, device=dev))],
        block_size=bs, prefix_len=P,
    )
    embeds = model.prefix_embeds(encode_images(model, images)).reshape(I * P, -1)
    model.forward_tokens(embeds, pos_IP.reshape(-1), batch, cache)

    # 2. Every prompt against its image's prefix, padded to the longest prompt.
    B = len(rows)
    lens = [len(specs[s].prompt) for _, s in rows]
    T = max(lens)
    tok_BT = torch.zeros(B, T, dtype=torch.long)
    pos_BT = torch.full((B, T), PAD_POS, dtype=torch.long)
    for b, (_, s) in enumerate(rows):
        tok_BT[b, : lens[b]] = torch.tensor(specs[s].prompt)
        pos_BT[b, : lens[b]] = torch.arange(P, P + lens[b])
    real = pos_BT != PAD_POS
    tok_N, pos_N = tok_BT[real].to(dev), pos_BT[real].to(dev)
    q_rows = torch.full((B, T), int(real.sum()), dtype=torch.long)
    q_rows[real] = torch.arange(int(real.sum()))
    kv_len = torch.tensor([logical_len(P + n, bs, P) for n in lens], device=dev)
    batch = AttentionBatch(
        write_slots=slots_of(tables_t, pos_BT.to(dev).clamp_max(P + T), bs, P)[real.to(dev)],
        groups=[AttentionGroup(q_rows.to(dev), pos_BT.to(dev), tables_t, kv_len)],
        block_size=bs, prefix_len=P,
    )
    hidden = model.forward_tokens(model.text.wte[tok_N], pos_N, batch, cache)
    last = q_rows[torch.arange(B), torch.tensor(lens) - 1].to(dev)
    hidden_BC = hidden[last]

    seeds = seeds or [[0] * S for _ in range(I)]
    modes = [specs[s].mode for _, s in rows]
    state = RowState(
        mode=torch.tensor(modes, device=dev),
        phase=torch.zeros(B, dtype=torch.long, device=dev),
        count=torch.zeros(B, dtype=torch.long, device=dev),
        limit=torch.tensor([specs[s].limit for _, s in rows], device=dev),
        after_prompt=torch.ones(B, dtype=torch.bool, device=dev),
        temperature=torch.tensor([specs[s].temperature for _, s in rows], device=dev),
        top_p=torch.tensor([specs[s].top_p for _, s in rows], device=dev),
        seed=torch.tensor([seeds[i][s] for i, s in rows], device=dev),
    )
    sampling = any(sp.temperature > 0 for sp in specs)
    outputs = [RawOutput.empty() for _ in rows]
    active = list(range(B))
    next_pos = torch.tensor([P + n for n in lens], device=dev)

    # 3. Step all unfinished sequences together.
    while True:
        d = decide(model, hidden_BC, state, sampling)
        finished = apply_decision([outputs[b] for b in active], [modes[b] for b in active], d)
        keep = [k for k, f in enumerate(finished) if not f]
        if not keep:
            break
        keep_t = torch.tensor(keep, device=dev)
        active = [active[k] for k in keep]
        state = state.index(keep_t)
        act_t = torch.tensor(active, device=dev)
        pos = next_pos[act_t]
        table = tables_t[act_t]
        n = len(active)
        batch = AttentionBatch(
            write_slots=slots_of(table, pos, bs, P),
            groups=[AttentionGroup(torch.arange(n, device=dev)[:, None], pos[:, None], table,
                                   P_pad + pos - P + 1)],
            block_size=bs, prefix_len=P,
        )
        embeds = model.input_embeds(d.next_kind[keep_t], d.next_token[keep_t], d.next_value[keep_t])
        hidden_BC = model.forward_tokens(embeds, pos, batch, cache)
        next_pos[act_t] += 1

    return [[outputs[i * S + s] for s in range(S)] for i in range(I)]
