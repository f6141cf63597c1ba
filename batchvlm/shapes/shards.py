"""Webdataset shards of shapes scenes, with the ground truth beside each image (`<key>.json`)."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

from .world import SPEC, Scene, draw_scene, encode


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible bytes
    tar.addfile(info, io.BytesIO(data))


def write_shards(out_dir: Path, n_shards: int, per_shard: int, seed: int, prefix: str = "shapes") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        rng = random.Random(f"shards/{seed}/{s}")
        path = out_dir / f"{prefix}-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(per_shard):
                image, scene = draw_scene(rng, SPEC)
                data, ext = encode(image, rng)
                key = f"{s:06d}_{i:04d}"
                _add(tar, f"{key}.{ext}", data)
                _add(tar, f"{key}.json", json.dumps(scene.to_json()).encode())
        paths.append(path)
    return paths


def read_truth(shard: Path) -> dict[str, Scene]:
    """key -> scene, from the `.json` members of a shard."""
    truth = {}
    with tarfile.open(shard) as tar:
        for m in tar.getmembers():
            if m.name.endswith(".json"):
                truth[m.name[: -len(".json")]] = Scene.from_json(json.loads(tar.extractfile(m).read()))
    return truth
