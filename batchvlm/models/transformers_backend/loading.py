"""A Hugging Face checkpoint through transformers: its config, processor and image-text-to-text
model, or one line saying why not.

`trust_remote_code` is never enabled: only architectures transformers ships are loaded, so no
code from a model repository runs. Only safetensors weights are read (`use_safetensors=True`): nothing is
unpickled. Everything is read from the local folder (`local_files_only`): hub downloads happen
before, in one place, with the revision the job pins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base.errors import ModelLoadError
from ..base.hub import read_json, weight_files
from .processor import load_processor, missing_backends

INSTALL = "pip install 'batchvlm[transformers]'"


def transformers_module() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(f"model.backend: the transformers backend needs the transformers package: {INSTALL}") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@dataclass(frozen=True)
class HostSide:
    """What the run needs before any weights: the config, the processor, the model class."""

    folder: Path
    model_type: str
    config: Any  # transformers PretrainedConfig
    processor: Any  # transformers ProcessorMixin (image processor + tokenizer + chat template)
    model_class: type


def image_text_to_text_class(transformers: ModuleType, config) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as NAMES

    name = NAMES.get(config.model_type)
    if name is None or not hasattr(transformers, name):
        raise ModelLoadError(f"model.name: model_type {config.model_type!r} is not an image-text-to-text model that "
                             f"transformers {transformers.__version__} can load (AutoModelForImageTextToText)")
    cls = getattr(transformers, name)
    if missing := missing_backends(cls):
        raise ModelLoadError(f"model.name: model_type {config.model_type!r}: transformers {transformers.__version__}'s "
                             f"{name} needs {' and '.join(missing)}, which cannot be imported here")
    return cls


def host_side(folder: Path) -> HostSide:
    transformers = transformers_module()
    raw = read_json(folder / "config.json")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{folder}/config.json: no model_type")
    try:
        # False said outright: transformers would otherwise ask on the terminal for a repo with code.
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        why = ("needs the repository's own code, which batchvlm never runs" if "auto_map" in raw
               else f"is unknown to transformers {transformers.__version__}")
        raise ModelLoadError(f"{folder}/config.json: model_type {model_type!r} {why} "
                             f"({type(e).__name__})") from None
    cls = image_text_to_text_class(transformers, config)
    weight_files(folder)  # a safetensors checkpoint is there, before any work starts
    try:
        processor = load_processor(transformers, model_type, folder)
    except (LookupError, ValueError, OSError, TypeError) as e:
        raise ModelLoadError(f"model.name: model_type {model_type!r}: cannot build its processor from {folder}: "
                             f"{str(e).strip().splitlines()[0]}") from None
    return HostSide(folder, model_type, config, processor, cls)


def load_model(host: HostSide, dtype, device) -> Any:
    """The model, in `dtype` on `device`, in eval mode, without gradients."""
    try:
        model = host.model_class.from_pretrained(str(host.folder), config=host.config, dtype=dtype,
                                                 use_safetensors=True, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{host.folder}: transformers cannot load the weights: "
                             f"{str(e).strip().splitlines()[0]}") from None
    return model.to(device).eval().requires_grad_(False)
