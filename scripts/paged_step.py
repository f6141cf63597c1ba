"""A synthetic paged attention step for the attention benchmark, the flex smoke test and the GPU
tests: rows on images round-robin, each row `queries` own tokens (1 = a decode step) ending at a
random own index below `own_max`, each image a `prefix`-token prefix, all in distinct cache blocks
(block 0 stays the null block)."""

from __future__ import annotations

import numpy as np
import torch

from batchvlm.engine.staging import rows_by_image
from batchvlm.attention import AttentionBatch, SharedPrefix, TaskGroup


def paged_step(images: int, rows: int, prefix: int, own_max: int, bs: int, device: torch.device | str,
               queries: int = 1, seed: int = 0) -> tuple[AttentionBatch, int, int]:
    """-> (batch, cache slots, minimal K/V tokens one layer reads)."""
    g = np.random.default_rng(seed)
    own_max = max(own_max, queries)
    nbp, nbo = -(-prefix // bs), -(-own_max // bs)
    image_tables = 1 + np.arange(images * nbp).reshape(images, nbp)
    own_tables = 1 + images * nbp + np.arange(rows * nbo).reshape(rows, nbo)
    last = g.integers(queries - 1, own_max, size=rows)  # own index of each row's last query
    own_tables[np.arange(nbo)[None] * bs > last[:, None]] = 0  # unused table tail -> null block
    q_own = last[:, None] - queries + 1 + np.arange(queries)[None]  # [rows, queries]
    q_rows = np.arange(rows * queries).reshape(rows, queries)
    image = np.arange(rows) % images
    by_image, slot = rows_by_image(image, q_rows, images, rows * queries)
    blocks = np.take_along_axis(own_tables, q_own // bs, axis=1)

    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)

    group = TaskGroup(t(q_rows), t(q_own), t(own_tables), t(last + 1),
                      SharedPrefix(t(image_tables), t(np.full(images, prefix)), t(by_image), t(slot), prefix, True))
    n_slots = (1 + images * nbp + rows * nbo) * bs
    write = (blocks * bs + q_own % bs).reshape(-1)
    return AttentionBatch(t(write), [group], bs), n_slots, images * prefix + int((last + 1).sum())
