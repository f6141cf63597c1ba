"""What batchvlm knows about each architecture beyond what transformers loads: how a task is put
into words for it, and in which format (if any) it writes boxes and points.

caption / query work for every image-text-to-text model; detect / point only where the
model's grounding format is known (one parser per format in base/grounding.py). The Qwen
formats take their words from qwen_vl/prompts.py, the table the native Qwen families use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..base import grounding
from ..qwen_vl.prompts import QWEN3, QWEN25
from ..florence2.prompts import DETECT_TOKEN as FLORENCE2_DETECT

Style = Literal["chat", "paligemma", "florence2"]


@dataclass(frozen=True)
class GroundingFormat:
    name: str
    detect: str  # the instruction, {object} filled in
    point: str | None  # None: the format has no points
    boxes: Callable[..., list[grounding.Box]]
    points: Callable[..., list[grounding.Point]] | None = None
    absolute: bool = False  # coordinates are pixels of the image as the model saw it (after its resize)
    # Coordinates may be special tokens (Florence-2's <loc_N>, PaliGemma's <locNNNN>): the text is
    # decoded with them. False: ordinary text, read by qwen_vl/prompts.py answer_text.
    special_tokens: bool = True


FORMATS = {f.name: f for f in [
    GroundingFormat("qwen2.5-vl", QWEN25.detect, QWEN25.point, grounding.qwen25_boxes, grounding.qwen25_points,
                    absolute=True, special_tokens=False),
    GroundingFormat("qwen3-vl", QWEN3.detect, QWEN3.point, grounding.qwen3_boxes, grounding.qwen3_points,
                    special_tokens=False),
    GroundingFormat("florence-2", FLORENCE2_DETECT + "{object}", None, grounding.florence2_boxes),
    GroundingFormat("paligemma", "detect {object}", None, grounding.paligemma_boxes),
    GroundingFormat("internvl", "Please provide the bounding box coordinate of the region this sentence "
                                "describes: <ref>{object}</ref>", None, grounding.internvl_boxes),
]}

# config.json model_type -> grounding format
GROUNDING = {"qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl", "qwen3_vl_moe": "qwen3-vl", "qwen3_5": "qwen3-vl",
             "qwen3_5_moe": "qwen3-vl", "florence2": "florence-2", "paligemma": "paligemma", "internvl": "internvl"}

# Models that take task words rather than a chat conversation.
STYLES: dict[str, Style] = {"paligemma": "paligemma", "florence2": "florence2"}


def supported_formats() -> str:
    """For error messages: each format with the model types that write it and what it can do."""
    parts = []
    for name, f in FORMATS.items():
        types = ", ".join(t for t, n in GROUNDING.items() if n == name)
        parts.append(f"{name} ({types}: detect{' + point' if f.point else ''})")
    return "; ".join(parts)


def grounding_format(model_type: str) -> GroundingFormat | None:
    name = GROUNDING.get(model_type)
    return FORMATS[name] if name else None


def style(model_type: str) -> Style:
    return STYLES.get(model_type, "chat")
