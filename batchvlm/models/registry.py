"""`model.name` -> a loaded model family. 'demo' is the model shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from ..job import ModelSpec
from .moondream.family import Moondream
from .moondream.preprocess import Preprocessor
from .moondream.weights import read_config, resolve_dir

DEMO_DIR = Path(__file__).parent / "demo"


def locate(spec: ModelSpec) -> tuple[Path, str | None]:
    """The model's local folder (downloading a hub snapshot if needed) and resolved revision."""
    if spec.name == "demo":
        return DEMO_DIR, None
    return resolve_dir(spec.name, spec.revision)


def preprocessor(folder: Path, spec: ModelSpec) -> Preprocessor:
    """The CPU-side preprocessing, from the config alone (workers start before weights load)."""
    config = read_config(folder)
    return Preprocessor(config.vision, spec.max_crops or config.vision.max_crops)


def load(spec: ModelSpec, folder: Path, revision: str | None) -> Moondream:
    return Moondream.load(spec.name, revision, spec.dtype, spec.device, spec.max_crops, folder=folder)
