"""The fused paged attention (attention/fused.py) equals the reference on random paged
batches, and reads the cache in place. On CPU flex_attention runs eagerly (compile=False): the
same block masks and mask_mods as the compiled CUDA kernel, without minutes of C++ compiles on
a shared CPU; the compiled kernel itself is checked by tests/gpu/test_gpu.py."""

import pytest
import torch
from support.paged_batches import random_batch, run

from batchvlm.attention import ReferenceAttention
from batchvlm.attention.fused import FusedAttention, bucket

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("causal", [False, True, "mixed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_equals_reference_on_random_paged_batches(causal, seed):
    batch, N = random_batch(seed, causal, n_pad_rows=3)
    want, want_cache = run(ReferenceAttention(), batch, N, seed)
    got, got_cache = run(FusedAttention(compile=False), batch, N, seed)
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    real = batch.write_slots != 0  # padding rows write and read only the null block
    assert real.sum() < N
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)
    assert torch.isfinite(got).all()  # padding rows too: they feed the scratch row's decoding


def test_the_check_can_fail():
    """A mask that hides a decode token's own key from it is caught by the comparison."""
    batch, N = random_batch(4, False, n_pad_rows=0)
    want, _ = run(ReferenceAttention(), batch, N, 4)
    decode = batch.groups[2]
    decode.q_own = (decode.q_own - 1).clamp(min=0)
    got, _ = run(FusedAttention(compile=False), batch, N, 4)
    assert not torch.allclose(got[decode.q_rows[:, 0]], want[decode.q_rows[:, 0]], atol=1e-3)


def test_kv_stays_in_the_model_dtype():
    batch, N = random_batch(5, True, n_pad_rows=1)
    want, _ = run(ReferenceAttention(), batch, N, 5, torch.bfloat16)
    got, cache = run(FusedAttention(compile=False), batch, N, 5, torch.bfloat16)
    assert got.dtype == cache.k.dtype == torch.bfloat16
    real = batch.write_slots != 0
    torch.testing.assert_close(got[real], want[real], atol=2e-2, rtol=2e-2)


def test_buckets_bound_the_shapes():
    assert [bucket(n) for n in (0, 1, 2, 3, 64, 65, 730)] == [1, 1, 2, 4, 64, 128, 1024]
