"""A classify task's choices as tokens (models/base/host.py), built the same way by every family:
each choice's own tokens in order; two choices the model cannot tell apart, and a choice that
merges with the prompt's last token, are refused naming the field."""

import pytest

from batchvlm.models.base.errors import FamilyError
from batchvlm.models.base.host import choice_tokens, tokens_after


def chars(text: str) -> list[int]:
    """A toy tokenizer: one token per character, except that ": " is one token."""
    return [1 if piece == "\x01" else ord(piece) for piece in text.replace(": ", "\x01")]


def test_each_choice_is_its_own_tokens_in_order():
    assert choice_tokens(0, ["no", "yes"], lambda c: tuple(chars(c))) == [(110, 111), (121, 101, 115)]


def test_two_choices_with_the_same_tokens_are_refused_naming_both():
    lower = lambda c: tuple(chars(c.lower()))  # noqa: E731 - a tokenizer that folds case
    with pytest.raises(FamilyError, match=r"^tasks\.2\.classify\.choices: 'cat' and 'Cat' are the same tokens "
                                          r"for this model$"):
        choice_tokens(2, ["cat", "dog", "Cat"], lower)


def test_a_choice_in_context_is_what_it_adds_to_the_prompt():
    assert tokens_after(chars, "Q:", chars("Q:"), "yes", 0) == (121, 101, 115)


@pytest.mark.parametrize("choice", [" yes", ""])  # ": " becomes one token; nothing added
def test_a_choice_that_merges_with_the_prompt_is_refused(choice):
    with pytest.raises(FamilyError, match=rf"^tasks\.1\.classify\.choices: {choice!r} merges with the prompt's last "
                                          "token$"):
        tokens_after(chars, "Q:", chars("Q:"), choice, 1)
