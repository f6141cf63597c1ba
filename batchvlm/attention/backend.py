"""What an attention backend is, and what the engine may ask of one without knowing which.

A backend plans a step's groups once per forward and attends them per layer. The engine asks it
two more things, and nothing else: whether its kernels read the cache in place (else a decode
group gathers dense prefix copies into a PrefixView, which start-up sizing must reserve), and
to fix its compiled shapes to the engine's maxima (`MaskBounds`; a backend that compiles
nothing ignores them). Compiled kernel shapes are counted process-wide in `COMPILED`, which the
engine reports in its stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .layout import AttentionBatch, Reads, bucket


@dataclass(frozen=True)
class MaskBounds:
    """The engine's fixed maxima that every paged mask is padded to (one compiled shape per kind)."""

    rows: int  # sequences in one step; images in one step (each has >= 1 row) are as many at most
    own_blocks: int  # widest own block table
    prefix_blocks: int  # widest prefix block table
    prompt: int  # longest prompt (own queries of one sequence in a prompt step)
    seqs_per_image: int

    def own(self, Tq: int) -> tuple[int, int, int]:
        """(entries, queries, table width) of an own part with Tq queries per sequence."""
        return self.rows, 1 if Tq == 1 else bucket(self.prompt), self.own_blocks

    def prefix(self, M: int) -> tuple[int, int, int]:
        """The same for a prefix part with M queries per image (decode: <= one per sequence)."""
        per = self.seqs_per_image
        return self.rows, per if M <= per else per * bucket(self.prompt), self.prefix_blocks


@dataclass
class CompileStats:
    """Process-wide: flex_attention graphs compiled (one per dynamo cache entry) and the seconds of
    the calls that compiled them."""

    shapes: int = 0
    seconds: float = 0.0


COMPILED = CompileStats()


class AttentionBackend(Protocol):
    # True: the kernels read K/V where they lie in the cache, and no PrefixView is ever filled.
    reads_in_place: bool

    def fix_shapes(self, bounds: MaskBounds) -> None:
        """Pad every mask from now on (graph captures included) to the engine's maxima, so the
        compiled kernel shapes are fixed (attention/fused.py). Called before the first step."""

    def plan(self, batch: AttentionBatch, n_slots: int) -> Any:
        """Per-forward tensors shared by all layers, for a cache of n_slots slots per layer."""

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, batch: AttentionBatch, plans: Any,
               reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
        """Write this step's keys/values into their slots, then attend every group. -> [N, H, D].
        `layer`: the call's layer, named by families whose prefix reads may use a PrefixView."""
