"""Finding and loading a Moondream 2 checkpoint: a local folder or a Hugging Face repo id.

A model folder is laid out like the hub repository:
    config.json        {"model_type": "moondream1", "config": {text, vision, region, tokenizer}}
                       (an empty "config" is full-size Moondream 2)
    model.safetensors  tensors named model.vision.*, model.text.*, model.region.*
    tokenizer.json     optional; else the tokenizer repo moondream/starmie-v1
Hub downloads go through huggingface_hub, so HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and
revisions behave as everywhere else. Only safetensors are read: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, MoondreamConfig
from .model import MoondreamModel

TOKENIZER_REPO = "moondream/starmie-v1"
FILES = ["config.json", "model.safetensors", "tokenizer.json"]


class ModelLoadError(RuntimeError):
    pass


def resolve_dir(name: str, revision: str | None) -> tuple[Path, str | None]:
    """(local folder, resolved revision) for a folder path or a hub repo id."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path, revision
    if path.is_absolute() or name.startswith(".") or name.count("/") != 1:
        raise ModelLoadError(f"model.name: {name!r} is neither a folder nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(f"model.name: cannot fetch {name!r} (revision {revision or 'main'}): {e}") from e
    return folder, folder.name  # snapshots/<commit>: the commit the revision resolved to


def read_config(folder: Path) -> MoondreamConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    raw = json.loads(path.read_text())
    if "config" in raw:
        if raw.get("model_type", "moondream1") != "moondream1":
            raise ModelLoadError(f"{path}: model_type {raw['model_type']!r} is not moondream1")
        raw = raw["config"] or {}
    try:
        return MoondreamConfig.from_dict(raw)
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def weights_sha256(path: Path) -> str:
    """Content hash of the weights. In the hub cache the blob is named by it already."""
    real = path.resolve()
    if real.parent.name == "blobs" and len(real.name) == 64:
        return real.name
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def load_weights(model: MoondreamModel, path: Path) -> None:
    """Strict copy: every parameter present with its exact shape, nothing extra."""
    params = {f"model.{k}": p for k, p in model.named_parameters()}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing, unexpected = sorted(params.keys() - keys), sorted(keys - params.keys())
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}")
            raise ModelLoadError(f"{path}: " + "; ".join(parts))
        for name, param in params.items():
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise ModelLoadError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(param.shape)}")
            with torch.no_grad():
                param.copy_(f.get_tensor(name))


def build_model(config: MoondreamConfig, device: torch.device, dtype: torch.dtype) -> MoondreamModel:
    """Allocate without initializing (weights are loaded next)."""
    with torch.device("meta"):
        model = MoondreamModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    local = folder / "tokenizer.json"
    if local.is_file():
        return Tokenizer.from_file(str(local))
    from huggingface_hub import hf_hub_download

    try:
        return Tokenizer.from_file(hf_hub_download(TOKENIZER_REPO, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any failure means: no tokenizer available
        raise ModelLoadError(f"{folder}: no tokenizer.json and cannot fetch {TOKENIZER_REPO}: {e}") from e
