"""How batchvlm puts each task to a Qwen VLM and reads the answer back: one table per prompt
generation, used by the native families and the transformers backend alike, so that both
backends send the same words and read the same text (the transformers backend is the
in-pipeline reference for the native ones).

Every task is one user turn [image, words] in the checkpoint's chat template with the
generation prompt, rendered with TEMPLATE_VARIABLES: Qwen3 / Qwen3.5 templates switch thinking
off with `enable_thinking` (labels are answers, not reasoning); a template without the switch
ignores it, and one that still opens a thinking block (a thinking-only checkpoint such as
Qwen3-VL-*-Thinking: its generation prompt ends in `<think>`) is refused. An answer (caption, query, and the JSON of a detect / point sequence, which is also
`<name>_raw`) is the generated text decoded without special tokens, stripped: `answer_text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..base.errors import ModelLoadError

TEMPLATE_VARIABLES = {"enable_thinking": False}


def refuse_thinking_only(turn: str, model_name: str) -> None:
    """`turn`: one user turn with the generation prompt, rendered with TEMPLATE_VARIABLES. Raises
    where it leaves the answer inside a `<think>` block (a thinking block closed empty, as
    Qwen3.5's template writes it with thinking off, is fine)."""
    if turn.rfind("<think>") > turn.rfind("</think>"):
        raise ModelLoadError(f"model.name: {model_name!r} is a thinking-only checkpoint (its chat template opens "
                             "a <think> block after every question, whatever enable_thinking says); batchvlm "
                             "labels with answers, not reasoning: use the model's Instruct variant")


@dataclass(frozen=True)
class QwenPrompts:
    captions: dict[str, str]  # caption length -> words
    detect: str  # one sequence per object, {object} filled in
    point: str

    def words(self, kind: str, args: Any, obj: str | None = None) -> str:
        """The words of one sequence of a task (`args`: its arguments; `obj`: a detect / point object)."""
        if kind == "caption":
            return self.captions[args.length]
        if kind == "query":
            return args.question
        if kind == "ocr":
            return OCR
        return (self.detect if kind == "detect" else self.point).format(object=obj)


CAPTIONS = {"short": "Describe this image in one sentence.", "normal": "Describe this image.",
            "long": "Describe this image in detail."}
OCR = "Read all the text in the image."  # every chat model's `ocr` task

# Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): the Qwen3-VL cookbook's grounding words.
# The transformers backend maps model types to these through its grounding formats
# (transformers_backend/architectures.py).
QWEN3 = QwenPrompts(
    CAPTIONS,
    detect='Locate every instance that belongs to the following categories: "{object}". Report bbox coordinates '
           'in JSON format.',
    point="Locate every {object} in this image with points. Output the point coordinates in JSON format.")

# Qwen2.5-VL: its own cookbook's words (its coordinates are pixels of the resized image).
QWEN25 = QwenPrompts(
    CAPTIONS,
    detect="Locate every {object} in the image and output the bbox coordinates in JSON format.",
    point="Locate every {object} in the image and output the point coordinates in JSON format.")


def answer_text(decode_skipping_specials: Callable[[Sequence[int]], str], tokens: Sequence[int]) -> str:
    return decode_skipping_specials(list(tokens)).strip()
