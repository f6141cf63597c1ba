"""`model.name` -> the host side of its family (no weights yet). 'demo' is the model shipped
inside the package; otherwise config.json's `model_type` picks the family: a native one where
batchvlm has it, else (model.backend auto or transformers) the transformers backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..job import EngineSpec, ModelSpec
from .family import Family, ModelLoadError
from .florence2.family import Florence2
from .hub import read_json, resolve_dir
from .moondream.family import Moondream
from .qwen3_5.family import Qwen35
from .qwen3_vl.family import Qwen3VL

DEMO_DIR = Path(__file__).parent / "demo"

# model_type -> opener(folder, spec, resolved revision)
FAMILIES: dict[str, Callable[[Path, ModelSpec, str | None], Family]] = {
    "moondream1": lambda folder, spec, rev: Moondream.open(folder, spec.name, rev, spec.max_crops),
    "qwen3_vl": Qwen3VL.open,
    "qwen3_vl_moe": Qwen3VL.open,  # the config says which MLP
    "florence2": Florence2.open,
    "qwen3_5": Qwen35.open,
    "qwen3_5_moe": Qwen35.open,
}
# What a family's host side reads of a hub repo: config, tokenizer (tokenizer.model: sentencepiece;
# *.tiktoken: tiktoken tokenizers), templates: everything but the weights. Never *.bin / *.pt
# (pickles) or *.py (remote code).
HOST_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HUB_FILES = HOST_FILES + ["*.safetensors"]  # what any family reads of a hub repo


def open_family(spec: ModelSpec, weights: bool = True) -> Family:
    """The family of `spec`'s model, from its folder (downloading a hub snapshot if needed;
    `weights=False`: only the small files its host side reads, for validate / --dry-run)."""
    if spec.name == "demo":
        folder, revision = DEMO_DIR, None
    else:
        folder, revision = resolve_dir(spec.name, spec.revision, HUB_FILES if weights else HOST_FILES)
    model_type = read_json(folder / "config.json").get("model_type", "moondream1")
    native = FAMILIES.get(model_type)
    if native is None and spec.backend == "native":
        raise ModelLoadError(f"model.backend: native, but batchvlm has no native family for model_type "
                             f"{model_type!r} (native: {', '.join(sorted(FAMILIES))}); use transformers or auto")
    if native is not None and spec.backend != "transformers":
        if model_type == "moondream1" and (given := [f for f in ("min_pixels", "max_pixels") if getattr(spec, f)]):
            raise ModelLoadError(f"model.{given[0]}: a Qwen3-VL setting; Moondream sees fixed-size crops "
                                 "(fewer: model.max_crops)")
        family = native(folder, spec, revision)
    else:
        if spec.max_crops is not None:
            raise ModelLoadError("model.max_crops: a Moondream setting; the transformers backend sizes images "
                                 "with the checkpoint's own image processor")
        from .transformers_backend.family import TransformersFamily

        family = TransformersFamily.open(folder, spec.name, revision)
    if spec.family not in ("auto", family.name):
        raise ModelLoadError(f"model.family: {spec.family!r}, but {spec.name!r} is a {family.name} model")
    return family


def check_tasks(spec: ModelSpec, tasks: list, engine: EngineSpec, constrain: bool = False) -> None:
    """What the model side of `validate` checks, loading no weights: the family's host side builds
    and every task becomes sequences it can run (raises ModelLoadError / FamilyError naming the
    field). `run` calls it before it writes anything, so a refused job leaves no output folder."""
    open_family(spec, weights=False).sequences(tasks, engine, constrain)
