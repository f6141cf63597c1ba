"""classify and json through transformers: choices scored by one forward, answers constrained by
the grammar's masks inside `generate`.

classify: the prompt is the one a query with that question gets. A choice's tokens are those of
the choice written after the prompt (encoded in context), then the end-of-turn token
(`<|im_end|>` where the tokenizer has it, else its eos token). Each choice runs as one forward
of the whole batch: [left-padded prompt | choice ids, right-padded]; the log-probabilities of its
tokens (float32 log-softmax) are summed per row. Padding after a row's choice is masked out and
comes after every scored position, so it changes nothing.

json: a `LogitsProcessor` holds one grammar matcher per row (base/grammar.py); `generate` calls
it synchronously, so here the mask of step k is computed after forward k (the native engines
overlap the two: engine/scheduler.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ...tasks import Task, args_of, kind_of
from ..base.errors import FamilyError
from ..base.contract import TaskSequence
from ..base.grammar import RowGrammars, Vocabulary, apply_mask_
from ..base.host import choice_tokens, tokens_after


def end_of_turn(tokenizer) -> int:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return im_end if isinstance(im_end, int) and im_end != tokenizer.unk_token_id else tokenizer.eos_token_id


def with_choices(seqs: list[TaskSequence], tasks: list[Task], tokenizer) -> list[TaskSequence]:
    """Classify prompts get their choices' ids in context. Raises FamilyError naming the field
    when two choices are the same tokens, or a choice does not follow the prompt's tokens."""
    end, out = end_of_turn(tokenizer), []
    for p in seqs:
        task = tasks[p.task]
        if kind_of(task) == "classify":
            text, encode = p.spec.text, partial(tokenizer.encode, add_special_tokens=False)
            base = encode(text)
            ids = choice_tokens(p.task, args_of(task).choices,
                                lambda c: (*tokens_after(encode, text, base, c, p.task), end))
            p = replace(p, spec=replace(p.spec, choices=tuple(ids)))
        elif kind_of(task) == "json":
            try:
                import xgrammar  # noqa: F401
            except ImportError:
                raise FamilyError(f"tasks.{p.task}.json: needs xgrammar: pip install 'batchvlm[structured]'") from None
        out.append(p)
    return out


def _extend(v, B: int, T: int, n: int):
    """Per-token inputs besides the ids and mask (token types: text = 0) grow by the choice's n."""
    if isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (B, T):
        return torch.cat([v, v.new_zeros(B, n)], 1)
    return v


def score_choices(model, enc: dict, choices: tuple[tuple[int, ...], ...]) -> list[list[float]]:
    """-> per row, each choice's summed log-probability after the row's (left-padded) prompt."""
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    B, T = ids_BT.shape
    scores_CB = []
    for choice in choices:
        c = torch.tensor(choice, device=ids_BT.device).expand(B, -1)
        extended = {k: _extend(v, B, T, len(choice)) for k, v in enc.items()}
        extended |= {"input_ids": torch.cat([ids_BT, c], 1), "attention_mask": torch.cat([mask_BT, torch.ones_like(c)], 1)}
        logits_BLV = model(**extended).logits[:, T - 1: T - 1 + len(choice)].float()
        logp_BL = torch.log_softmax(logits_BLV, -1).gather(-1, c[..., None])[..., 0]
        scores_CB.append(logp_BL.sum(-1))
    return torch.stack(scores_CB, 1).tolist()


class GrammarLogits:
    """A transformers LogitsProcessor: each row's answer follows the grammar."""

    def __init__(self, vocab: Vocabulary, grammar, batch: int, prompt_len: int):
        self.rows = RowGrammars(batch, vocab)
        for r in range(batch):
            self.rows.start(r, grammar)
        self.prompt_len, self.mask_BW = prompt_len, torch.empty(batch, self.rows.W, dtype=torch.int32)

    def __call__(self, input_ids_BT: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        rows = list(range(input_ids_BT.shape[0]))
        if input_ids_BT.shape[1] > self.prompt_len:  # feed the token the last step emitted
            self.rows.advance(rows, input_ids_BT[:, -1].tolist())
        self.rows.fill(rows, self.mask_BW)
        return apply_mask_(scores_BV, self.mask_BW.to(scores_BV.device))

    def whole_with(self, row: int, last: int) -> bool:
        """After `generate`: row's answer is whole with its last token (`generate` never fed it here)."""
        answer = self.rows.answers[row]
        answer.accept(last)
        return answer.complete
