"""Host -> device uploads of vision inputs through persistent pinned buffers.

A batch of images' crops is concatenated straight into page-locked memory (one host copy) and
copied up asynchronously on the current stream (the vision stream, in the engine). Two buffers
alternate: before a buffer is written again, the host waits for the upload that last read it,
two batches back, which has long finished in a running pipeline. On CPU there is nothing to
overlap: the parts are concatenated, once.
"""

from __future__ import annotations

import torch


class PinnedUpload:
    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._read: list[torch.cuda.Event | None] = [None, None]  # the upload that last read each buffer
        self._next = 0

    def __call__(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[n_i, ...] host tensors of one dtype -> their concatenation [sum n_i, ...] on the device."""
        if self.device.type != "cuda":
            return torch.cat(parts)
        i, self._next = self._next, self._next ^ 1
        shape = torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        n = shape.numel()
        buf = self._bufs[i]
        if self._read[i] is not None:
            self._read[i].synchronize()
        if buf is None or buf.numel() < n or buf.dtype != parts[0].dtype:
            # Grows rarely (largest batch so far, with headroom); the old buffer is released by
            # the caching host allocator only once its last copy is done.
            buf = self._bufs[i] = torch.empty(max(n, 2 * (buf.numel() if buf is not None else 0)),
                                              dtype=parts[0].dtype, pin_memory=True)
        staged = buf[:n].view(shape)
        torch.cat(parts, out=staged)
        out = staged.to(self.device, non_blocking=True)
        self._read[i] = torch.cuda.Event()
        self._read[i].record()
        return out
