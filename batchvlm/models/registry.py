"""`model.name` -> the host side of its family (no weights yet). 'demo' is the model shipped
inside the package; otherwise config.json's `model_type` picks the family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..job import ModelSpec
from .family import Family, ModelLoadError
from .hub import read_json, resolve_dir
from .moondream.family import Moondream

DEMO_DIR = Path(__file__).parent / "demo"

# model_type -> opener(folder, spec, resolved revision)
FAMILIES: dict[str, Callable[[Path, ModelSpec, str | None], Family]] = {
    "moondream1": lambda folder, spec, rev: Moondream.open(folder, spec.name, rev, spec.max_crops),
}
HOST_FILES = ["*.json", "*.jinja", "*.txt"]  # what a family's host side reads: config, tokenizer, templates
HUB_FILES = HOST_FILES + ["*.safetensors"]  # what any family reads of a hub repo


def open_family(spec: ModelSpec, weights: bool = True) -> Family:
    """The family of `spec`'s model, from its folder (downloading a hub snapshot if needed;
    `weights=False`: only the small files its host side reads, for validate / --dry-run)."""
    if spec.name == "demo":
        folder, revision = DEMO_DIR, None
    else:
        folder, revision = resolve_dir(spec.name, spec.revision, HUB_FILES if weights else HOST_FILES)
    model_type = read_json(folder / "config.json").get("model_type", "moondream1")
    opener = FAMILIES.get(model_type)
    if opener is None:
        raise ModelLoadError(f"model.name: {spec.name!r} is a {model_type!r} model; batchvlm serves "
                             f"{', '.join(sorted(FAMILIES))}")
    family = opener(folder, spec, revision)
    if spec.family not in ("auto", family.name):
        raise ModelLoadError(f"model.family: {spec.family!r}, but {spec.name!r} is a {family.name} model")
    return family
