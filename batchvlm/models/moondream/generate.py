"""Simple batched generation: a static batch of images x sequences, one host sync per step.

This is the straightforward way to batch Moondream: encode all images, prefill every image
prefix once, prefill every task prompt against its image's shared prefix, then step all
unfinished sequences together until none is left. It is the reference the engine
(batchvlm/engine) must match label for label, and a baseline in scripts/bench_engine.py.
"""

from __future__ import annotations

import numpy as np
import torch

from ...attention import PAD, AttentionBatch, PrefixGroup, SharedPrefix, TaskGroup, slot_of
from ..base.decoding import RawOutput, RowState, SeqSpec
from .grammar import apply_decision
from .decoding import decide
from .model import MoondreamModel
from .preprocess import PreparedImage


def encode_images(model: MoondreamModel, images: list[PreparedImage]) -> torch.Tensor:
    """Vision stage for a batch of images -> [I, grid*grid, C]."""
    crops = torch.cat([im.crops for im in images]).to(model.device)
    return model.vision(crops, [im.tiling for im in images])


def prefix_inputs(model: MoondreamModel, images: list[PreparedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image's prefix, flat: (embeddings [n, C], positions [n]). With duplicate pruning
    (PreparedImage.keep) the kept tokens only, each at 1 + its grid index (vision.py forward_kept)."""
    dev, P = model.device, model.config.prefix_len
    if images[0].keep is None:
        return model.prefix_embeds(encode_images(model, images)).reshape(len(images) * P, -1), \
            torch.arange(P, device=dev).repeat(len(images))
    crops = torch.cat([im.crops for im in images]).to(dev)
    keeps = [im.keep.to(dev) for im in images]
    features = model.vision.forward_kept(crops, [im.tiling for im in images], keeps)
    parts = [model.kept_prefix(f, k) for f, k in zip(features, keeps)]
    return torch.cat([e for e, _ in parts]), torch.cat([p for _, p in parts])


def _blocks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


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
    P, bs = model.config.prefix_len, block_size  # P: the full prefix; own positions start there
    lens = [im.prefix_len for im in images]  # KV slots of each prefix (fewer where pruned)
    L, full = max(lens), all(n == P for n in lens)
    nbp = -(-L // bs)
    I, S = len(images), len(specs)
    B = I * S  # row b = (image b // S, spec b % S)
    own_blocks = [-(-(len(sp.prompt) + sp.budget) // bs) for sp in specs]
    cache = model.new_kv_cache(1 + I * nbp + I * sum(own_blocks), bs)
    prefix_t = torch.tensor([_blocks(1 + i * nbp, nbp) for i in range(I)], dtype=torch.long, device=dev)
    next_block, tables = 1 + I * nbp, []
    for b in range(B):
        n = own_blocks[b % S]
        tables.append(_blocks(next_block, n) + [0] * (max(own_blocks) - n))
        next_block += n
    own_t = torch.tensor(tables, dtype=torch.long, device=dev)
    lens_I = torch.tensor(lens, device=dev)
    image_of = torch.arange(B, device=dev) // S

    # 1. Vision, then every image prefix once: a bidirectional prefill per image.
    pre_img = torch.repeat_interleave(torch.arange(I, device=dev), lens_I)
    j = torch.arange(pre_img.shape[0], device=dev) - (torch.cumsum(lens_I, 0) - lens_I)[pre_img]
    q_pre = torch.full((I, L), pre_img.shape[0], dtype=torch.long, device=dev)
    q_pre[pre_img, j] = torch.arange(pre_img.shape[0], device=dev)
    batch = AttentionBatch(slot_of(prefix_t[pre_img], j, bs), [PrefixGroup(q_pre, prefix_t, lens_I, causal=False)], bs)
    model.forward_tokens(*prefix_inputs(model, images), batch, cache)

    def shared(q_rows_BT: torch.Tensor, n_rows: int) -> SharedPrefix:
        """Each image's queries: rows b of image i are i*S .. i*S+S-1, in order."""
        Tq = q_rows_BT.shape[1]
        by_image = q_rows_BT.reshape(I, S * Tq)
        q_slot = torch.arange(B * Tq, device=dev).view(B, Tq)
        q_slot = torch.where(q_rows_BT == n_rows, I * S * Tq, q_slot)
        return SharedPrefix(prefix_t, lens_I, by_image, q_slot, L, full)

    # 2. Every prompt against its image's prefix, padded to the longest prompt.
    lens = [len(specs[b % S].prompt) for b in range(B)]
    T = max(lens)
    own_BT = np.full((B, T), PAD, dtype=np.int64)
    for b, n in enumerate(lens):
        own_BT[b, :n] = np.arange(n)
    real = own_BT != PAD
    n_tok = int(real.sum())
    q_rows = np.full((B, T), n_tok, dtype=np.int64)
    q_rows[real] = np.arange(n_tok)
    tok = np.concatenate([specs[b % S].prompt for b in range(B)])
    own_pos = torch.from_numpy(own_BT[real]).to(dev)
    q_rows_t = torch.from_numpy(q_rows).to(dev)
    owner = torch.from_numpy(np.repeat(np.arange(B), lens)).to(dev)
    batch = AttentionBatch(slot_of(own_t[owner], own_pos, bs),
                           [TaskGroup(q_rows_t, torch.from_numpy(own_BT).to(dev), own_t, torch.tensor(lens, device=dev),
                                      shared(q_rows_t, n_tok))], bs)
    hidden = model.forward_tokens(model.text.wte[torch.from_numpy(tok).to(dev)], P + own_pos, batch, cache)
    hidden_BC = hidden[q_rows_t[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]]

    seeds = seeds or [[0] * S for _ in range(I)]
    modes = [specs[b % S].mode for b in range(B)]
    state = RowState(
        mode=torch.tensor(modes, device=dev),
        phase=torch.zeros(B, dtype=torch.long, device=dev),
        count=torch.zeros(B, dtype=torch.long, device=dev),
        limit=torch.tensor([specs[b % S].limit for b in range(B)], device=dev),
        after_prompt=torch.ones(B, dtype=torch.bool, device=dev),
        temperature=torch.tensor([specs[b % S].temperature for b in range(B)], device=dev),
        top_p=torch.tensor([specs[b % S].top_p for b in range(B)], device=dev),
        seed=torch.tensor([seeds[b // S][b % S] for b in range(B)], device=dev),
    )
    sampling = any(sp.temperature > 0 for sp in specs)
    outputs = [RawOutput.empty() for _ in range(B)]
    active = list(range(B))
    next_own = torch.tensor(lens, device=dev)

    # 3. Step all unfinished sequences together (one token each, grouped by image).
    while True:
        d = decide(model, hidden_BC, state, sampling)
        finished = apply_decision([outputs[b] for b in active], [specs[b % S] for b in active], d)
        keep = [k for k, f in enumerate(finished) if not f]
        if not keep:
            break
        keep_t = torch.tensor(keep, device=dev)
        active = [active[k] for k in keep]
        state = state.index(keep_t)
        act = torch.tensor(active, device=dev)
        n = len(active)
        o = next_own[act]
        img = image_of[act]
        counts = torch.bincount(img, minlength=I)
        M = int(counts.max())
        rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[img]  # active is sorted by image
        by_image = torch.full((I, M), n, dtype=torch.long, device=dev)
        by_image[img, rank] = torch.arange(n, device=dev)
        prefix = SharedPrefix(prefix_t, lens_I, by_image, (img * M + rank)[:, None], L, full)
        batch = AttentionBatch(slot_of(own_t[act], o, bs),
                               [TaskGroup(torch.arange(n, device=dev)[:, None], o[:, None], own_t[act], o + 1, prefix)],
                               bs)
        embeds = model.input_embeds(d.next_kind[keep_t], d.next_token[keep_t], d.next_value[keep_t])
        hidden_BC = model.forward_tokens(embeds, P + o, batch, cache)
        next_own[act] += 1

    return [[outputs[i * S + s] for s in range(S)] for i in range(I)]
