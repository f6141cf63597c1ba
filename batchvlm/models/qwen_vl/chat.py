"""The checkpoint's chat template, rendered in a sandboxed Jinja environment, split into the
part every task on an image shares and the part each task owns.

One user turn [image, text] with the generation prompt renders as
    <head>  <|image_pad|>  <|vision_end|><text and assistant header>
(Qwen3-VL: head = "<|im_start|>user\\n<|vision_start|>"). The head, the image's pad tokens
and vision_end are the image prefix: computed once per image, shared by all its tasks. A
template whose head depends on the task text cannot share a prefix and is refused.

The template comes from tokenizer_config.json (`chat_template`: a string, or a list of named
templates, "default" taken), else chat_template.jinja, else chat_template.json. It renders in
base/templates.py's sandbox: no Python internals, bounded in time and size. The turn is
rendered with qwen_vl/prompts.py's TEMPLATE_VARIABLES (thinking off, where the template has
the switch), as the transformers backend renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from .prompts import TEMPLATE_VARIABLES
from ..base.errors import ConfigError
from ..base.templates import render, template_file


def read_template(folder: Path) -> tuple[str, str]:
    """-> (the template, the file it came from)."""
    tpl, origin = template_file(folder)
    if tpl is None:
        raise ConfigError(f"{folder}: no chat template (tokenizer_config.json, chat_template.jinja or .json)")
    return tpl, origin


def special_tokens(folder: Path) -> dict[str, str]:
    """bos_token / eos_token / pad_token / unk_token strings, for templates that use them."""
    cfg = folder / "tokenizer_config.json"
    raw = json.loads(cfg.read_text()) if cfg.is_file() else {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = raw.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # the file it came from, for messages
    variables: dict[str, Any]  # special token strings
    image_pad: str  # "<|image_pad|>"
    vision_end: str  # "<|vision_end|>"

    def render(self, text: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        try:
            return render(self.source, dict(messages=messages, add_generation_prompt=True, **TEMPLATE_VARIABLES,
                                            **self.variables))
        except TemplateError as e:
            raise ConfigError(f"{self.origin}: chat template: {e}") from e

    def split(self, text: str) -> tuple[str, str]:
        """-> (head before the image pad, the task's own text after vision_end)."""
        rendered = self.render(text)
        if rendered.count(self.image_pad) != 1:
            raise ConfigError(f"chat template: expected one {self.image_pad} for one image, "
                              f"got {rendered.count(self.image_pad)}")
        head, _, rest = rendered.partition(self.image_pad)
        if not rest.startswith(self.vision_end):
            raise ConfigError(f"chat template: {self.image_pad} is not followed by {self.vision_end}")
        return head, rest[len(self.vision_end):]

    def head(self) -> str:
        """The image prefix's head text; the same for every task text (checked)."""
        a, _ = self.split("a")
        b, _ = self.split("b c")
        if a != b:
            raise ConfigError("chat template: the text before the image depends on the question, so tasks "
                              "cannot share an image prefix")
        return a
