"""The checkpoint's chat template, rendered in a sandboxed Jinja environment, split into the
part every task on an image shares and the part each task owns.

One user turn [image, text] with the generation prompt renders as
    <head>  <|image_pad|>  <|vision_end|><text and assistant header>
(Qwen3-VL: head = "<|im_start|>user\\n<|vision_start|>"). The head, the image's pad tokens
and vision_end are the image prefix: computed once per image, shared by all its tasks. A
template whose head depends on the task text cannot share a prefix and is refused.

The template comes from tokenizer_config.json (`chat_template`: a string, or a list of named
templates, "default" taken), else chat_template.jinja, else chat_template.json. The sandbox
refuses attribute access to Python internals: a hostile template cannot run code. The turn is
rendered with qwen_vl/prompts.py's TEMPLATE_VARIABLES (thinking off, where the template has
the switch), as the transformers backend renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .prompts import TEMPLATE_VARIABLES
from ..base.errors import ConfigError


def read_template(folder: Path) -> str:
    cfg = folder / "tokenizer_config.json"
    raw = json.loads(cfg.read_text()) if cfg.is_file() else {}
    tpl = raw.get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if not tpl and (folder / "chat_template.jinja").is_file():
        tpl = (folder / "chat_template.jinja").read_text()
    if not tpl and (folder / "chat_template.json").is_file():
        tpl = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if not isinstance(tpl, str) or not tpl:
        raise ConfigError(f"{folder}: no chat template (tokenizer_config.json, chat_template.jinja or .json)")
    return tpl


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


def _raise(message: str) -> None:
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    variables: dict[str, Any]  # special token strings
    image_pad: str  # "<|image_pad|>"
    vision_end: str  # "<|vision_end|>"

    def render(self, text: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        try:
            return _environment().from_string(self.source).render(
                messages=messages, add_generation_prompt=True, **TEMPLATE_VARIABLES, **self.variables)
        except TemplateError as e:
            raise ConfigError(f"chat template: {e}") from e

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
