"""`model.name` -> the host side of its family (no weights yet). 'demo' is the model shipped
inside the package; otherwise config.json's `model_type` picks the family: a native one where
batchvlm has it, else (model.backend auto or transformers) the transformers backend.

Families register lazily: `FAMILIES` names where each lives, and nothing of a family is imported
until a job names it."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from ..job import EngineSpec, ModelSpec
from .base.contract import Family
from .base.errors import ModelLoadError
from .base.hub import read_json, resolve_dir, weight_files

DEMO_DIR = Path(__file__).parent / "demo"

# model_type -> "module:class" of its family's host side (base/host.py FamilyBase), opened with
# `open(folder, spec, resolved revision)`
FAMILIES: dict[str, str] = {
    "moondream1": "batchvlm.models.moondream.host:Moondream",
    "qwen3_vl": "batchvlm.models.qwen3_vl.host:Qwen3VL",
    "qwen3_vl_moe": "batchvlm.models.qwen3_vl.host:Qwen3VL",  # the config says which MLP
    "florence2": "batchvlm.models.florence2.host:Florence2",
    "qwen3_5": "batchvlm.models.qwen3_5.host:Qwen35",
    "qwen3_5_moe": "batchvlm.models.qwen3_5.host:Qwen35",
    "siglip": "batchvlm.models.siglip.host:Siglip",  # fixed resolution (SigLIP 2 FixRes, SigLIP)
    "siglip2": "batchvlm.models.siglip.host:Siglip",  # NaFlex
}
TRANSFORMERS = "batchvlm.models.transformers_backend.host:TransformersFamily"
# What a family's host side reads of a hub repo: config, tokenizer (tokenizer.model: sentencepiece;
# *.tiktoken: tiktoken tokenizers), templates: everything but the weights. Never *.bin / *.pt
# (pickles) or *.py (remote code).
HOST_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HUB_FILES = HOST_FILES + ["*.safetensors"]  # what any family reads of a hub repo


def family_class(where: str) -> type:
    """"module:class" -> the class, importing its family."""
    module, _, name = where.partition(":")
    return getattr(import_module(module), name)


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
    where = native if native is not None and spec.backend != "transformers" else TRANSFORMERS
    family = family_class(where).open(folder, spec, revision)
    if spec.family not in ("auto", family.name):
        raise ModelLoadError(f"model.family: {spec.family!r}, but {spec.name!r} is a {family.name} model")
    if spec.prune_duplicates is not None and not family.can_prune():
        raise ModelLoadError(f"model.prune_duplicates: {family.name} ({family.backend}) cannot drop duplicate visual "
                             "tokens (native Qwen3-VL, Qwen3.5, Florence-2 and Moondream can); remove the setting")
    return family


def check_tasks(spec: ModelSpec, tasks: list, engine: EngineSpec, constrain: bool = False) -> None:
    """What the model side of `validate` checks, loading no weights: the family's host side builds
    and every task becomes sequences it can run (raises ModelLoadError / FamilyError naming the
    field). `run` calls it before it writes anything, so a refused job leaves no output folder.
    A local folder's checkpoint is looked at too (safetensors: a folder with only
    `pytorch_model.bin` is refused, as loading it would be); a hub repo's weights are fetched by the
    run, validate fetches only its small files."""
    open_family(spec, weights=False).sequences(tasks, engine, constrain)
    if spec.name != "demo" and Path(spec.name).expanduser().is_dir():
        weight_files(Path(spec.name).expanduser())
