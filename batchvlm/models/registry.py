"""`model.name` -> the host side of its family (no weights yet). 'demo' is the model shipped
inside the package; otherwise config.json's `model_type` picks the family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..job import ModelSpec
from .family import Family, ModelLoadError
from .hub import read_json, resolve_dir
from .moondream.family import Moondream
from .qwen3_vl.family import Qwen3VL

DEMO_DIR = Path(__file__).parent / "demo"

# model_type -> opener(folder, spec, resolved revision)
FAMILIES: dict[str, Callable[[Path, ModelSpec, str | None], Family]] = {
    "moondream1": lambda folder, spec, rev: Moondream.open(folder, spec.name, rev, spec.max_crops),
    "qwen3_vl": Qwen3VL.open,
}
HUB_FILES = ["*.json", "*.jinja", "*.safetensors", "*.txt"]  # what any family reads of a hub repo


def open_family(spec: ModelSpec) -> Family:
    """The family of `spec`'s model, from its folder (downloading a hub snapshot if needed)."""
    if spec.name == "demo":
        folder, revision = DEMO_DIR, None
    else:
        folder, revision = resolve_dir(spec.name, spec.revision, HUB_FILES)
    model_type = read_json(folder / "config.json").get("model_type", "moondream1")
    opener = FAMILIES.get(model_type)
    if opener is None:
        raise ModelLoadError(f"model.name: {spec.name!r} is a {model_type!r} model; batchvlm serves "
                             f"{', '.join(sorted(FAMILIES))}")
    family = opener(folder, spec, revision)
    if spec.family not in ("auto", family.name):
        raise ModelLoadError(f"model.family: {spec.family!r}, but {spec.name!r} is a {family.name} model")
    return family
