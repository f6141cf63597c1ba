"""Tasks in words: the text each task's sequences hand the processor, beside the image.

Chat models get one user turn (the image, then the instruction) through the processor's own
chat template, ending with the assistant header, rendered with qwen_vl/prompts.py TEMPLATE_VARIABLES
where the template reads them (thinking off); their caption words and the Qwen grounding words
are qwen_vl/prompts.py's, the native Qwen families' table. PaliGemma gets its task prefixes
("caption en", "answer en ...", "detect ..."; the processor adds the image tokens, BOS and the newline);
Florence-2 gets its task tokens (models/florence2/prompts.py, shared with the native family; the
processor turns them into its instructions). `ocr` is an instruction (PaliGemma: its "ocr" prefix);
`regions` only Florence-2 can do.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...tasks import Task, args_of, kind_of
from ..base.errors import FamilyError
from ..base.host import check_generative
from ..base.contract import TaskSequence
from ..florence2 import prompts as florence2
from ..qwen_vl.prompts import CAPTIONS, OCR, TEMPLATE_VARIABLES
from .architectures import GroundingFormat, Style, supported_formats

CHAT_CAPTIONS = CAPTIONS  # every chat model: the words the native Qwen families use
PALIGEMMA_CAPTIONS = {"short": "caption en", "normal": "caption en", "long": "describe en"}


@dataclass(frozen=True)
class Prompt:
    """What `generate` runs for one sequence (TaskSequence.spec of this backend)."""

    text: str  # what the processor gets beside the image
    max_new_tokens: int
    choices: tuple[tuple[int, ...], ...] = ()  # classify: each choice's ids after `text`, then the end token
    schema: dict | None = None  # json: decoding is constrained to it


def _words(kind: str, args, obj: str | None, style: Style, fmt: GroundingFormat | None) -> str:
    if style == "florence2" and kind != "point":
        return florence2.task_text(kind, args, obj)
    if kind == "caption":
        return {"chat": CHAT_CAPTIONS, "paligemma": PALIGEMMA_CAPTIONS}[style][args.length]
    if kind in ("query", "classify"):  # a classify prompt is the query's, so its answer is scored
        return f"answer en {args.question}" if style == "paligemma" else args.question
    if kind == "json":
        return args.prompt
    if kind == "ocr":
        return "ocr" if style == "paligemma" else OCR
    template = fmt.detect if kind == "detect" else fmt.point
    return template.format(object=obj)


def prompts_for(tasks: list[Task], style: Style, fmt: GroundingFormat | None, chat_template, model_type: str,
                max_new_tokens: int, max_objects: int) -> list[TaskSequence]:
    """Every sequence an image runs, in task order. `chat_template(words) -> text` renders one user
    turn, or is None when the model has none. Raises FamilyError naming the task."""
    out = []
    for i, task in enumerate(tasks):
        kind, args = kind_of(task), args_of(task)
        check_generative(i, task, f"model_type {model_type!r}")
        if kind == "regions" and style != "florence2":
            raise FamilyError(f"tasks.{i}.regions: region captions are a Florence-2 task; model_type "
                              f"{model_type!r} cannot do them")
        if kind in ("detect", "point") and (fmt is None or (kind == "point" and fmt.point is None)):
            known = f"its format, {fmt.name}, has no points" if fmt else "batchvlm knows no grounding format for it"
            raise FamilyError(f"tasks.{i}.{kind}: model_type {model_type!r} through the transformers backend "
                              f"cannot {kind} ({known}); supported formats: {supported_formats()}")
        if kind in ("classify", "json") and style != "chat":
            raise FamilyError(f"tasks.{i}.{kind}: model_type {model_type!r} is not a chat model; batchvlm runs "
                              f"{kind} tasks on chat models only")
        if style == "chat" and chat_template is None:
            raise FamilyError(f"tasks.{i}.{kind}: the model has no chat template (chat_template.jinja / .json or in "
                              "tokenizer_config.json), so batchvlm cannot put a task to it")
        # A detect / point answer lists every object: its length is bounded by max_new_tokens too.
        spatial = kind in ("detect", "point")
        budget = None if spatial or kind == "classify" else args.max_new_tokens
        for obj in (args.objects if spatial else [None]):
            words = _words(kind, args, obj, style, fmt)
            text = chat_template(words) if style == "chat" else words
            out.append(TaskSequence(i, obj, Prompt(text, budget or max_new_tokens,
                                                   schema=args.json_schema if kind == "json" else None),
                                    (args.max_objects or max_objects) if spatial or kind == "regions" else None))
    return out


def chat_renderer(processor):
    """words -> the text of one user turn (image, then words) and the assistant header, through
    the checkpoint's chat template (the processor's, else the tokenizer's); None without one."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        return None
    # Only what the template reads: transformers hands other keywords to the processor call.
    switches = {k: v for k, v in TEMPLATE_VARIABLES.items() if k in template}

    def render(words: str) -> str:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}]
        return processor.apply_chat_template(turn, chat_template=template, add_generation_prompt=True, tokenize=False,
                                             **switches)

    return render
