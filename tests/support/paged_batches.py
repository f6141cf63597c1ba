"""Random paged attention batches (every kind of group, graph-style padding rows) and one
attention call over a random cache: the fused backend's checks against the reference."""

import numpy as np
import torch

from batchvlm.attention import (PAD, AttentionBatch, KVCache, PrefixGroup, SharedPrefix, TaskGroup, attend,
                                plan_groups)
from batchvlm.engine.staging import rows_by_image

H, HKV, D, BS, N_BLOCKS = 4, 2, 8, 4, 96


class Blocks:
    """Hands out distinct random physical blocks (never the null block 0)."""

    def __init__(self, g: np.random.Generator):
        self.free = list(g.permutation(np.arange(1, N_BLOCKS)))

    def take(self, n_tokens: int, width: int) -> list[int]:
        n = -(-n_tokens // BS)
        return [int(self.free.pop()) for _ in range(n)] + [0] * (width - n)


def random_batch(seed: int, causal: bool | str, n_pad_rows: int, device: str = "cpu") -> tuple[AttentionBatch, int]:
    """One step with every kind of group: new prefixes (variable lengths), prompts of tasks that
    share an image or have one alone, decode tokens, and graph-style padding rows (null block,
    a padding image with a one-slot prefix). causal "mixed": each prefix is bidirectional over a
    random head of it, causal after (an image part before a prefix prompt). -> (batch, N flat tokens)."""
    g = np.random.default_rng(seed)
    blocks = Blocks(g)
    rows, write = 0, []

    # New image prefixes, prefilled this step.
    new_lens = g.integers(1, 13, size=3)
    L, nbp = int(new_lens.max()), 4
    new_tables = np.array([blocks.take(n, nbp) for n in new_lens])
    q_pre = np.full((3, L), -1)
    for i, n in enumerate(new_lens):
        q_pre[i, :n] = rows + np.arange(n)
        write += [t[j // BS] * BS + j % BS for t in [new_tables[i]] for j in range(n)]
        rows += n
    # Images already in the cache (their K/V is the random cache content).
    old_lens = g.integers(1, 14, size=3)
    old_tables = np.array([blocks.take(n, nbp) for n in old_lens])

    # Prompts: sequences 0-2 share image 0, 3 is alone on image 2.
    prompt_image = np.array([0, 0, 0, 2])
    prompt_lens = g.integers(1, 7, size=4)
    T, now = int(prompt_lens.max()), 3
    prompt_tables = np.array([blocks.take(n, now) for n in prompt_lens])
    q_prompt, own_prompt = np.full((4, T), -1), np.full((4, T), PAD)
    for s, n in enumerate(prompt_lens):
        q_prompt[s, :n], own_prompt[s, :n] = rows + np.arange(n), np.arange(n)
        write += [prompt_tables[s][j // BS] * BS + j % BS for j in range(n)]
        rows += n

    # Decode tokens: 5 sequences on images 1, 1, 2, 0, 1, then padding rows (graph layout).
    decode_image = np.array([1, 1, 2, 0, 1] + [3] * n_pad_rows)  # image 3: the padding image
    own = np.concatenate([g.integers(0, 11, size=5), np.zeros(n_pad_rows, dtype=np.int64)])
    decode_tables = np.array([blocks.take(o + 1, now) for o in own[:5]] + [[0] * now] * n_pad_rows)
    q_decode = rows + np.arange(len(own))
    write += [decode_tables[b][o // BS] * BS + o % BS for b, o in enumerate(own)]
    rows += len(own)
    N = rows

    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)

    q_pre[q_pre < 0], q_prompt[q_prompt < 0] = N, N
    image_tables = np.concatenate([old_tables, np.zeros((1, nbp), dtype=np.int64)])
    image_lens = np.concatenate([old_lens, [1]])
    p_rows, p_slot = rows_by_image(prompt_image, q_prompt, 3, N)
    d_rows, d_slot = rows_by_image(decode_image[:5], q_decode[:5, None], 4, N)
    d_slot = np.concatenate([d_slot, np.full((n_pad_rows, 1), d_rows.size)])  # padding -> the zero slot
    groups = [
        PrefixGroup(t(q_pre), t(new_tables), t(new_lens), bool(causal),
                    bidir_lens=t(g.integers(0, new_lens + 1)) if causal == "mixed" else None),
        TaskGroup(t(q_prompt), t(own_prompt), t(prompt_tables), t(prompt_lens),
                  SharedPrefix(t(old_tables), t(old_lens), t(p_rows), t(p_slot))),
        TaskGroup(t(q_decode[:, None]), t(own[:, None]), t(decode_tables), t(own + 1),
                  SharedPrefix(t(image_tables), t(image_lens), t(d_rows), t(d_slot))),
    ]
    return AttentionBatch(t(write), groups, BS), N


def run(backend, batch: AttentionBatch, N: int, seed: int, dtype=torch.float32, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(torch.randn(1, N_BLOCKS * BS, HKV, D, generator=g).to(device, dtype),
                    torch.randn(1, N_BLOCKS * BS, HKV, D, generator=g).to(device, dtype), BS, backend)
    q, k, v = (torch.randn(N, h, D, generator=g).to(device, dtype) for h in (H, HKV, HKV))
    out = attend(q, k, v, cache.k[0], cache.v[0], batch, plan_groups(batch, cache))
    return out, cache
