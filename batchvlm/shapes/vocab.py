"""The demo model's tokenizer: a small byte-level BPE over the shapes world's language.

Ids 0-9 are Moondream's special ids (BOS = EOS = 0, answer 3, coord 5, size 6, ...); the task
and length markers follow. Input is lower-cased, so "How many shapes are there?" works.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .world import COLOURS, COUNT_QUESTION, KINDS, NUMBERS, colour_question

SPECIALS = [
    "<|endoftext|>", "<|prompt|>", "<|sep|>", "<|answer|>", "<|thinking|>", "<|coord|>", "<|size|>",
    "<|ground|>", "<|r8|>", "<|endground|>", "<|caption|>", "<|query|>", "<|detect|>", "<|point|>",
    "<|short|>", "<|normal|>", "<|long|>",
]
ID = {s: i for i, s in enumerate(SPECIALS)}

TEMPLATES = {
    "caption": {
        "short": [1, ID["<|caption|>"], 2, ID["<|short|>"], 3],
        "normal": [1, ID["<|caption|>"], 2, ID["<|normal|>"], 3],
        "long": [1, ID["<|caption|>"], 2, ID["<|long|>"], 3],
    },
    "query": {"prefix": [1, ID["<|query|>"], 2], "suffix": [3]},
    "detect": {"prefix": [1, ID["<|detect|>"], 2], "suffix": [3]},
    "point": {"prefix": [1, ID["<|point|>"], 2], "suffix": [3]},
}


def corpus() -> list[str]:
    words = [f"a {c} {k}" for c in COLOURS for k in KINDS]
    lines = [", ".join(words) + " and " + " and ".join(words) + "."]
    lines += [COUNT_QUESTION, "how many shapes?", "what colour is the"] + [colour_question(k) for k in KINDS]
    lines += [" " + k for k in KINDS] + [f" {c} {k}" for c in COLOURS for k in KINDS]
    lines += list(NUMBERS) + list(COLOURS) + [" ".join(NUMBERS), " ".join(COLOURS)]
    return lines * 4


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok
