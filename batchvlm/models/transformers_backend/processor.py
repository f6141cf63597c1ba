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
  usual and the video slot stays empty. A processor whose `__init__` insists on a video processor
  gets None for it; where that `__init__` hands it on to ProcessorMixin by keyword (Gemma 4's),
  a step between the two in the class order drops it, since ProcessorMixin refuses a keyword
  for a slot the subclass left out (SmolVLM passes it by position, which ProcessorMixin
  ignores past the slots). Where the class's own `apply_chat_template` exists only to
  fill in video defaults from that processor (SmolVLM's reads its frame count and fps), the shared
  ProcessorMixin one renders the image-only conversation instead: the same text.
"""

from __future__ import annotations

import inspect
import json
from functools import cache
from pathlib import Path
from typing import Any


# Processor classes whose apply_chat_template override only adds video defaults (transformers 5.x).
VIDEO_ONLY_CHAT_OVERRIDES = {"SmolVLMProcessor"}


@cache
def image_only(cls: type) -> type:
    """`cls` (a transformers ProcessorMixin) without its video processor."""
    from transformers import ProcessorMixin

    class DropVideo(ProcessorMixin):
        # In ImageOnly's class order this comes after `cls` and before ProcessorMixin: it is what
        # `cls.__init__`'s super().__init__ calls.
        def __init__(self, *args, **kwargs):
            kwargs.pop("video_processor", None)
            super().__init__(*args, **kwargs)

    class ImageOnly(cls, DropVideo):
        @classmethod
        def get_attributes(klass) -> list[str]:
            return [a for a in super().get_attributes() if "video" not in a]

    if cls.__name__ in VIDEO_ONLY_CHAT_OVERRIDES:
        ImageOnly.apply_chat_template = ProcessorMixin.apply_chat_template

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


def missing_backends(cls: type) -> list[str]:
    """The packages transformers says `cls` needs and this machine lacks (transformers puts a
    placeholder class in its place, which raises a multi-line ImportError when used)."""
    return sorted(cls._backends) if getattr(type(cls), "is_dummy", False) else []


def load_processor(transformers, model_type: str, folder: Path) -> Any:
    """Raises LookupError (one line) for a processor transformers cannot build here."""
    named = processor_class(transformers, model_type, folder)
    if missing := missing_backends(named):
        raise LookupError(f"transformers {transformers.__version__}'s {named.__name__} needs {' and '.join(missing)}, "
                          "which cannot be imported here")
    init = inspect.signature(named.__init__).parameters
    empty = {"video_processor": None} if "video_processor" in init else {}
    return image_only(named).from_pretrained(str(folder), backend="pil", local_files_only=True, **empty)
