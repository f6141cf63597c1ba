"""Counter-based sampling: uniforms strictly inside (0, 1) for every 32-bit input, and Gumbel-max
draws that stay on the greedy token when the model is sure, even at the extreme hash values."""

import pytest
import torch

import batchvlm.models.base.decoding as decoding
from batchvlm.models.base.decoding import RowState, sample_tokens, uniform, uniform_from_bits

EXTREMES = torch.tensor([0, 1, 2**31, 2**32 - 129, 2**32 - 128, 2**32 - 2, 2**32 - 1], dtype=torch.long)


def test_uniform_is_inside_the_open_interval_at_the_extremes():
    u = uniform_from_bits(EXTREMES)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    # The Gumbel term is finite for every one of them.
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())
    # The top 2^9 inputs share the largest value (23 bits kept); it is the float just below 1 - 2^-24.
    assert u[-1].item() == u[-3].item() == 1 - 2.0**-24
    assert u[0].item() == 2.0**-24


def test_uniform_covers_the_interval_evenly():
    u = uniform(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs((u < 0.1).float().mean().item() - 0.1) < 0.01


def _state(B: int, temperature: float, top_p: float = 1.0) -> RowState:
    z = torch.zeros(B, dtype=torch.long)
    return RowState(z, z, z, z + 100, z.bool(), torch.full((B,), temperature), torch.full((B,), top_p),
                    torch.arange(B, dtype=torch.long))


@pytest.fixture
def extreme_draws(monkeypatch):
    """The greedy token gets the smallest possible uniform, every other token the largest: the
    draw that most favours leaving the greedy token."""

    def draws(seed_B, step_B, V):
        bits = torch.full((seed_B.shape[0], V), 2**32 - 1, dtype=torch.long)
        bits[:, 0] = 0
        return uniform_from_bits(bits)

    monkeypatch.setattr(decoding, "uniform", draws)


def test_near_zero_temperature_never_leaves_the_greedy_token(extreme_draws):
    logits = torch.zeros(8, 50)
    logits[:, 0] = 1.0  # a confident model, by a margin that 1e-5 turns into certainty
    assert sample_tokens(logits, _state(8, 1e-5), sampling=True).tolist() == [0] * 8


def test_one_hot_row_samples_its_token(extreme_draws):
    """Every other probability underflows to 0 in float32: log 0 = -inf must stay -inf."""
    logits = torch.full((4, 50), -200.0)
    logits[:, 0] = 0.0
    assert sample_tokens(logits, _state(4, 1.0), sampling=True).tolist() == [0] * 4


def test_near_one_hot_row_samples_by_its_probabilities():
    B = 20000
    logits = torch.full((B, 3), -30.0)
    logits[:, 0] = 0.0
    logits[:, 1] = -4.0  # p = e^-4 / (1 + e^-4) ~ 0.018; token 2 is ~1e-13
    picked = sample_tokens(logits, _state(B, 1.0), sampling=True)
    share = (picked == 1).float().mean().item()
    assert 0.012 < share < 0.024, share
    assert not bool((picked == 2).any())
