"""batchvlm's tasks in Florence-2's words: the one mapping, shared by the native family and the
transformers backend.

A task becomes a task token (`<CAPTION>`, `<OPEN_VOCABULARY_DETECTION>` + the object, ...); a
query is its question as written, and so are a classify question and a json prompt (Florence-2 has
no chat template: they are asked as a query is). The processor (transformers' `Florence2Processor`) then turns a
task token into the instruction the model was trained on; `instruction()` does the same here,
with the processor's exact strings (the parity tests compare them with the processor's tables).
The encoder reads [image tokens][<s> instruction </s>].
"""

from __future__ import annotations

from typing import Any

CAPTION_TOKENS = {"short": "<CAPTION>", "normal": "<DETAILED_CAPTION>", "long": "<MORE_DETAILED_CAPTION>"}
DETECT_TOKEN = "<OPEN_VOCABULARY_DETECTION>"  # followed by the object name
OCR_TOKEN = "<OCR>"
REGIONS_TOKEN = "<DENSE_REGION_CAPTION>"

# Task token -> instruction, as Florence2Processor writes them.
INSTRUCTIONS = {
    "<OCR>": "What is the text in the image?",
    "<OCR_WITH_REGION>": "What is the text in the image, with regions?",
    "<CAPTION>": "What does the image describe?",
    "<DETAILED_CAPTION>": "Describe in detail what is shown in the image.",
    "<MORE_DETAILED_CAPTION>": "Describe with a paragraph what is shown in the image.",
    "<OD>": "Locate the objects with category name in the image.",
    "<DENSE_REGION_CAPTION>": "Locate the objects in the image, with their descriptions.",
    "<REGION_PROPOSAL>": "Locate the region proposals in the image.",
}
INSTRUCTIONS_WITH_INPUT = {
    "<CAPTION_TO_PHRASE_GROUNDING>": "Locate the phrases in the caption: {input}",
    "<REFERRING_EXPRESSION_SEGMENTATION>": "Locate {input} in the image with mask",
    "<REGION_TO_SEGMENTATION>": "What is the polygon mask of region {input}",
    "<OPEN_VOCABULARY_DETECTION>": "Locate {input} in the image.",
    "<REGION_TO_CATEGORY>": "What is the region {input}?",
    "<REGION_TO_DESCRIPTION>": "What does the region {input} describe?",
    "<REGION_TO_OCR>": "What text is in the region {input}?",
}

# What each task kind can be for Florence-2; `point` has no Florence-2 task.
KINDS = ("caption", "query", "detect", "ocr", "regions", "classify", "json")


def task_text(kind: str, args: Any, obj: str | None = None) -> str:
    """The text a sequence hands the processor: a task token (+ the object), or the question."""
    if kind == "caption":
        return CAPTION_TOKENS[args.length]
    if kind in ("query", "classify"):
        return args.question
    if kind == "json":
        return args.prompt
    if kind == "detect":
        return DETECT_TOKEN + obj
    if kind == "ocr":
        return OCR_TOKEN
    if kind == "regions":
        return REGIONS_TOKEN
    raise ValueError(f"Florence-2 has no task for {kind!r}")


def instruction(text: str) -> str:
    """What the processor makes of `text`: a lone task token becomes its instruction, a task
    token with input its template filled with the rest of the text (stripped); any other text
    is kept (a query). Like the processor, a task token must be the whole text when it takes no
    input."""
    for token, words in INSTRUCTIONS.items():
        if token in text:
            if text != token:
                raise ValueError(f"task token {token} must be the only content of the prompt")
            return words
    for token, template in INSTRUCTIONS_WITH_INPUT.items():
        if token in text:
            return template.format(input=text.replace(token, "").strip())
    return text
