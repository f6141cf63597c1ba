"""Counter-based sampling: uniforms strictly inside (0, 1) for every 32-bit input, and Gumbel-max
draws that stay on the greedy token when the model is sure, even at the extreme hash values; the
[B, V] work in blocks of rows (bounded temporaries) and the hash in int32, drawing what the whole
batch in int64 draws."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def _hash32_int64(x: torch.Tensor) -> torch.Tensor:
    """The hash as first written: int64 holding 32-bit values (the reference the draws keep)."""
    m = 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    return x ^ (x >> 16)


def test_the_int32_hash_is_the_int64_hash():
    x = torch.cat([torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(0)), EXTREMES])
    ref = _hash32_int64(x)
    as_int32 = decoding._hash32(torch.where(x >= 2**31, x - 2**32, x).to(torch.int32))
    assert as_int32.dtype == torch.int32
    assert torch.equal(as_int32.long() & 0xFFFFFFFF, ref)
    assert torch.equal(uniform_from_bits(as_int32), uniform_from_bits(ref))
    seed, step = torch.arange(0, 2**40, 2**34), torch.arange(64) * 7
    base = _hash32_int64(_hash32_int64(seed & 0xFFFFFFFF) ^ step)
    assert torch.equal(uniform(seed, step, 300), uniform_from_bits(_hash32_int64(base[:, None] ^ torch.arange(300))))


class LargestNew(TorchDispatchMode):
    """The largest storage the ops create, in bytes (a view or an in-place result is not new)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        new = [t for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held]
        self.largest = max([self.largest] + [t.untyped_storage().nbytes() for t in new])
        return out


def test_sampling_works_in_blocks_of_rows_and_draws_what_the_whole_batch_draws(monkeypatch):
    """No [B, V] sort order or hash: the largest temporary is one block's int64 sort order."""
    B, V = 48, 1000
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(1)) * 4
    st = RowState(*(torch.zeros(B, dtype=torch.long),) * 2, torch.arange(B) % 5, torch.full((B,), 100),
                  torch.zeros(B, dtype=torch.bool), torch.linspace(0.0, 1.5, B), torch.linspace(0.05, 1.0, B),
                  torch.arange(B) * 7919)
    whole = sample_tokens(logits, st, sampling=True)
    assert (whole != logits.argmax(-1)).sum() > 5  # sampling, not greedy
    monkeypatch.setattr(decoding, "SAMPLE_BLOCK", 5 * V)  # blocks of 5 rows, the last one short
    with LargestNew() as new:
        blocks = sample_tokens(logits, st, sampling=True)
    assert torch.equal(blocks, whole)
    assert new.largest <= 5 * V * 8, new.largest
