"""Memory the KV cache may take: free accelerator memory, or available host memory on CPU.

On CPU the cache is ordinary RAM, so it is bounded like CUDA's: by what the machine (or the
container's cgroup limit, when it is tighter) can still give without swapping.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup v2 memory limit, or None when there is no limit."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def host_available_bytes() -> int:
    candidates = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    if not candidates:  # not Linux: free physical pages
        candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return max(0, min(candidates))


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()
