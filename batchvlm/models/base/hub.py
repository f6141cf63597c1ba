"""What every family needs to find and read a checkpoint: a local folder or a Hugging Face repo
id, safetensors weights (one file or shards with an index), their hash, the device and dtype.

Hub downloads go through huggingface_hub, so HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and
revisions behave as everywhere else. Only safetensors are read: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import ModelFetchError, ModelLoadError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def resolve_dir(name: str, revision: str | None, allow_patterns: list[str] | None = None) -> tuple[Path, str | None]:
    """(local folder, resolved revision) for a folder path or a hub repo id."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path, revision
    if path.is_absolute() or name.startswith(".") or name.count("/") != 1:
        raise ModelLoadError(f"model.name: {name!r} is neither a folder nor a Hugging Face repo id")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        folder = Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=allow_patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        # Named as not there (or offline with nothing cached): the same job fails the same way.
        # Anything else (no network, 429, 5xx, a full disk) may pass on a later try.
        final = isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, ValueError)) or (
            isinstance(e, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE)
        error = ModelLoadError if final else ModelFetchError
        raise error(f"model.name: cannot fetch {name!r} (revision {revision or 'main'}): {e}") from e
    return folder, folder.name  # snapshots/<commit>: the commit the revision resolved to


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path.parent}: no {path.name}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: `model.safetensors`, or the shards an index names."""
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{folder / INDEX}: no weight_map")
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard(s) named by {INDEX} are missing: {missing[:3]}")
        return files
    raise ModelLoadError(f"{folder}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def _file_sha256(path: Path) -> str:
    real = path.resolve()
    if real.parent.name == "blobs" and len(real.name) == 64:  # the hub cache names blobs by it
        return real.name
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(files: list[Path]) -> str:
    """Content hash of the weights: the file's sha256, or for shards the sha256 of their
    names and hashes (so resharding the same tensors changes it, which is safe)."""
    if len(files) == 1:
        return _file_sha256(files[0])
    return hashlib.sha256("".join(f"{f.name}:{_file_sha256(f)}\n" for f in files).encode()).hexdigest()


def load_strict(params: Mapping[str, torch.Tensor], files: list[Path],
                rename: Callable[[str], str | None] = lambda k: k) -> None:
    """Copy checkpoint tensors into `params` (checkpoint name -> parameter): every parameter
    present with its exact shape, nothing extra. `rename` maps a stored name to the name in
    `params` (None: a tensor the family deliberately does not use)."""
    found: dict[str, tuple[Path, str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = rename(key)
                if name is not None:
                    found[name] = (path, key)
    missing, unexpected = sorted(params.keys() - found.keys()), sorted(found.keys() - params.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}")
        raise ModelLoadError(f"{files[0].parent}: " + "; ".join(parts))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name, (where, key) in found.items():
                if where != path:
                    continue
                param = params[name]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(param.shape):
                    raise ModelLoadError(f"{path}: tensor {key} has shape {list(shape)}, expected {list(param.shape)}")
                with torch.no_grad():
                    param.copy_(f.get_tensor(key))


def empty_on(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to_empty(device=device)` for a model built on the meta device, without meta
    `empty_like` (it loads torch's Python decompositions and sympy: most of a second of start-up
    per process). Each parameter and buffer becomes an uninitialized tensor of its shape and dtype;
    a parameter shared by several modules stays one parameter."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            setattr(module, name, made[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):  # setattr keeps a buffer (non-)persistent
            if id(b) not in made:
                made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
            setattr(module, name, made[id(b)])
    return model


def embedding_table(n: int, dim: int) -> torch.nn.Embedding:
    """An `nn.Embedding` without its random init, for a model whose weights are loaded next:
    `normal_` on the meta device runs through torch's Python references, which import
    torch._dynamo and sympy (about a second of start-up per process; see `empty_on`)."""
    return torch.nn.Embedding(n, dim, _weight=torch.empty(n, dim))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device: {device!r} but torch {torch.__version__} sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"model.device: {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_tokenizer(folder: Path, fallback_repo: str | None = None):
    """`tokenizer.json` from the folder, else from `fallback_repo` on the hub (cache first)."""
    from tokenizers import Tokenizer

    local = folder / "tokenizer.json"
    if local.is_file():
        return Tokenizer.from_file(str(local))
    if fallback_repo is None:
        raise ModelLoadError(f"{folder}: no tokenizer.json")
    from huggingface_hub import hf_hub_download

    try:
        return Tokenizer.from_file(hf_hub_download(fallback_repo, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any failure means: no tokenizer available
        raise ModelLoadError(f"{folder}: no tokenizer.json and cannot fetch {fallback_repo}: {e}") from e


class TokenizerAdapter:
    """A `tokenizers.Tokenizer` as families use it: ids without added specials; decoding skips
    special tokens or keeps them (`skip_special`)."""

    def __init__(self, tok, skip_special: bool = False):
        self._tok = tok
        self.skip_special = skip_special

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special)

    def id_of(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_of(self, id_: int) -> str | None:
        return self._tok.id_to_token(id_)
