"""The attention a Qwen text model is given by its caller (the engine's paged K/V, a test's dense
cache): the same weights run under either."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (kv layer, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D]; the kv layer is the
# layer's index among those that keep K/V (every layer in Qwen3-VL, the full ones in Qwen3.5)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
