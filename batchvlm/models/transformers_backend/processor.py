"""The model's processor (image processor + tokenizer + chat template), built the same way on
every machine.

Two choices make it robust and reproducible:
- The image processor is the PIL one (`backend="pil"`), never the torchvision one: labels do not
  depend on whether torchvision happens to be installed (resizes differ slightly between the
  two), and nothing breaks where torchvision does not import beside the installed torch.
- The processor class is loaded without its video processor. AutoProcessor (and the processor
  class itself) would build one for Qwen2-VL / Qwen2.5-VL / Qwen3-VL / SmolVLM / InternVL, and
  transformers' video processors need torchvision; batchvlm labels images only. `image_only`
  makes a subclass whose sub-processor list leaves the video slot out, so `from_pretrained` reads
  preprocessor_config.json, the tokenizer files, processor_config.json and the chat template as
  usual and the video slot stays empty.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any


@cache
def image_only(cls: type) -> type:
    """`cls` (a transformers ProcessorMixin) without its video processor."""

    class ImageOnly(cls):
        @classmethod
        def get_attributes(klass) -> list[str]:
            return [a for a in super().get_attributes() if "video" not in a]

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def processor_class(transformers, model_type: str, folder: Path) -> type:
    """The processor class named by the checkpoint (processor_config.json / tokenizer_config.json),
    else the one transformers maps the model type to."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for name in ("processor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            named = json.loads(path.read_text()).get("processor_class")
            if named and hasattr(transformers, named):
                return getattr(transformers, named)
    named = PROCESSOR_MAPPING_NAMES.get(model_type)
    if named is None or not hasattr(transformers, named):
        raise LookupError(f"transformers {transformers.__version__} has no processor for model_type {model_type!r}")
    return getattr(transformers, named)


def load_processor(transformers, model_type: str, folder: Path) -> Any:
    cls = image_only(processor_class(transformers, model_type, folder))
    return cls.from_pretrained(str(folder), backend="pil", local_files_only=True)
