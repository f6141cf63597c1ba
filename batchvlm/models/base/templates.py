"""A checkpoint's chat template, rendered as the untrusted program it is: sandboxed, and bounded
in time and in size.

Jinja's sandbox stops a template from reaching Python internals, but not from spending: nested
`range(100000)` loops, a string doubled in a namespace, `'x' * 10**9`. A real template renders one
prompt in milliseconds into a few kilobytes, so a render that takes longer than RENDER_SECONDS,
writes more than RENDER_CHARS characters, or builds any value larger than that (characters of a
string, items of a container, counted through nesting) stops with TemplateTooCostly. Where the
bounds are enforced:
- time: a trace function on the compiled template's frames (filename "<template>") checks the
  clock on every line they run, so a loop without calls stops too; other code runs untraced;
- output: the render is streamed (`Template.generate`) and counted chunk by chunk;
- values: every intercepted operator (`*`, `**`, `+`, `%`), call, filter, attribute or item read
  and `{{ }}` output checks its operands first (an integer argument past the bound, such as
  `center(10**9)`, is refused before it runs) and its result after.
What stays possible is one builtin step on a value already at the bound (`~` joining two such
strings): at most a few times RENDER_CHARS, not gigabytes.

Both backends render through `render`: the native Qwen families for their prompts, the
transformers backend as a trial of the same template before transformers' own
`apply_chat_template` renders it. The environment is transformers' (trim_blocks, lstrip_blocks,
loop controls, the `{% generation %}` tag, `raise_exception`, `strftime_now`, a JSON `tojson`),
so a template either renders the same here or fails the same way.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from functools import wraps
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0
RENDER_CHARS = 1_000_000
TEMPLATE_FILE = "<template>"  # the filename Jinja compiles `from_string` templates under
MAX_BITS = 4096  # integers: a template counts, it does not compute powers of ten thousand digits
LONG_NUMBER = re.compile(r"\d{7,}")  # a field width / precision of a million or more in a format string


class TemplateTooCostly(TemplateError):
    """The render went past RENDER_SECONDS or RENDER_CHARS (the message says which)."""


def template_file(folder: Path) -> tuple[str | None, str]:
    """-> (the template, the file it came from), in the order transformers reads them:
    tokenizer_config.json (`chat_template`: a string, or named templates, "default" taken),
    chat_template.jinja, chat_template.json."""
    cfg = folder / "tokenizer_config.json"
    raw = json.loads(cfg.read_text()) if cfg.is_file() else {}
    tpl = raw.get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if isinstance(tpl, str) and tpl:
        return tpl, str(cfg)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), str(folder / "chat_template.jinja")
    if (folder / "chat_template.json").is_file():
        tpl = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return (tpl if isinstance(tpl, str) and tpl else None), str(folder / "chat_template.json")
    return None, str(folder)


CONTAINERS = (list, tuple, dict, set, frozenset)


def _size(value: Any, budget: int) -> int:
    """Characters and items in `value`, counted through nesting; stops once past `budget`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, CONTAINERS):
        return 1
    total = 1 + len(value)
    if total > budget:
        return total
    for item in (x for kv in value.items() for x in kv) if isinstance(value, dict) else value:
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, CONTAINERS):
            total += _size(item, budget - total)
        if total > budget:
            break
    return total


def _check_value(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise TemplateTooCostly(f"computes a number of {value.bit_length()} bits")
    if _size(value, RENDER_CHARS) > RENDER_CHARS:
        raise TemplateTooCostly(f"builds a value of more than {RENDER_CHARS} characters or items")
    return value


def _check_arguments(args, kwargs) -> None:
    for a in [*args, *kwargs.values()]:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > RENDER_CHARS:
            raise TemplateTooCostly(f"asks for a width, count or repeat of {a} (more than {RENDER_CHARS})")
        _check_value(a)


def _check_format(text: Any) -> None:
    if isinstance(text, str) and LONG_NUMBER.search(text):
        raise TemplateTooCostly("formats with a width or precision of a million or more")


class Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks the assistant's part; here it
    only renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded(f):
    """A filter that refuses oversized operands and results."""

    @wraps(f)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_arguments(args, kwargs)
        if f.__name__ == "do_format" and args:
            _check_format(args[0])
        return _check_value(f(*args, **kwargs))

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"],
                         finalize=_check_value)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > MAX_BITS:
                raise TemplateTooCostly(f"computes {left} ** {right}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(seq, (str, list, tuple)) and _size(seq, RENDER_CHARS) * n > RENDER_CHARS:
                    raise TemplateTooCostly(f"builds a value of more than {RENDER_CHARS} characters or items")
        if operator == "%":
            _check_format(left)
        if operator == "+" and _size(left, RENDER_CHARS) + _size(right, RENDER_CHARS) > RENDER_CHARS + 1:
            raise TemplateTooCostly(f"builds a value of more than {RENDER_CHARS} characters or items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        _check_arguments(args, {k: v for k, v in kwargs.items() if not k.startswith("_")})
        return _check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)
        return _check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _check_value(super().getitem(obj, argument))


def _clock(deadline: float):
    """A trace function that stops the template's frames at `deadline` (other frames: untraced)."""

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTooCostly(f"takes longer than {RENDER_SECONDS:g} s to render one prompt")
        return line

    def call(frame, event, arg):
        return line(frame, event, arg) if frame.f_code.co_filename == TEMPLATE_FILE else None

    return call


def render(source: str, variables: dict[str, Any]) -> str:
    """The template rendered with `variables`. Raises TemplateError (TemplateTooCostly past the
    bounds): the caller names the template."""
    previous = sys.gettrace()
    sys.settrace(_clock(time.monotonic() + RENDER_SECONDS))
    try:
        out, n = [], 0
        for chunk in BoundedSandbox().from_string(source).generate(**variables):
            n += len(chunk)
            if n > RENDER_CHARS:
                raise TemplateTooCostly(f"writes more than {RENDER_CHARS} characters for one prompt")
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise TemplateTooCostly("recurses without end") from None
    finally:
        sys.settrace(previous)
