"""The engine's state kinds through the real engine, against dense one-sequence references
(tests/support/toy_states.py): a hybrid of linear-attention layers (recurrent state forked from the image
prefix's snapshot) and a full-attention layer, and an encoder-decoder whose prefixes are
(image, prompt) encodings read by cross-attention. Nothing leaks: blocks, rows, snapshots."""

import pytest
import torch
from support.toy_family import PIXELS, ToyImage
from support.toy_states import DEC_START, EncDecToy, HybridToy, encdec_reference, hybrid_reference

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.models.base.decoding import MODE_TEXT, SeqSpec
from batchvlm.models.base.contract import TaskSequence

LENGTHS = [3, 23, 5, 14, 8]


def _images(seed: int) -> list[ToyImage]:
    g = torch.Generator().manual_seed(seed)
    return [ToyImage(torch.randn(n, PIXELS, generator=g)) for n in LENGTHS]


def _run(model, images, specs, batch, pipelined):
    seqs = [TaskSequence(i, None, sp) for i, sp in enumerate(specs)]
    engine = Engine(model, seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined, max_images_in_flight=3,
                                            block_size=8), max_prefix_len=max(LENGTHS))
    got = {im.sample.index: [s.output.tokens for s in im.seqs]
           for im in engine.run(Sample(0, i, str(i), p) for i, p in enumerate(images))}
    sched = engine.scheduler
    assert sched.blocks.used == 0 and len(sched.free_rows) == engine.runner.n_rows  # nothing leaked
    assert sched.snapshots is None or sched.snapshots.free == sched.snapshots.n
    return [got[i] for i in range(len(images))], engine


@pytest.fixture(scope="module")
def hybrid():
    model, images = HybridToy(seed=4), _images(11)
    specs = [SeqSpec(MODE_TEXT, (5, 6, 7), 5), SeqSpec(MODE_TEXT, (8,), 3), SeqSpec(MODE_TEXT, (9, 10), 4)]
    want = [[hybrid_reference(model, im, sp) for sp in specs] for im in images]
    assert len({tuple(map(tuple, w)) for w in want}) > 1 and any(len(t) < 4 for w in want for t in w)
    return model, images, specs, want


@pytest.fixture(scope="module")
def encdec():
    model, images = EncDecToy(seed=6), _images(12)
    # Tasks 0 and 2 share a prefix (same encoder prompt); task 1 has its own prefix of each image.
    specs = [SeqSpec(MODE_TEXT, (DEC_START,), 5, prefix_prompt=(5, 6)),
             SeqSpec(MODE_TEXT, (DEC_START,), 4, prefix_prompt=(7, 8, 9)),
             SeqSpec(MODE_TEXT, (DEC_START, 11), 3, prefix_prompt=(5, 6))]
    want = [[encdec_reference(model, im, sp) for sp in specs] for im in images]
    assert any(w[0] != w[1] for w in want)  # the encoder prompt matters
    return model, images, specs, want


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("pipelined", [False, True])
def test_hybrid_recurrent_state_forks_from_the_prefix_snapshot(hybrid, batch, pipelined):
    model, images, specs, want = hybrid
    got, _ = _run(model, images, specs, batch, pipelined)
    assert got == want


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("pipelined", [False, True])
def test_encoder_decoder_cross_attends_to_an_image_prompt_prefix(encdec, batch, pipelined):
    model, images, specs, want = encdec
    model.encodes = 0
    got, engine = _run(model, images, specs, batch, pipelined)
    assert got == want
    # Vision features once per image, shared by its two prefixes (encoder K/V is per prefix).
    assert model.encodes == engine.stats["vision_images"] == len(images)


@pytest.mark.parametrize("batch, pipelined", [(1, False), (7, True), (64, False)])
def test_encoder_decoder_self_and_cross_kv_on_one_allocation(encdec, batch, pipelined):
    """CrossKV.shares: the cross K/V live in the self-attention's tensors (prefix blocks beside
    own blocks, never the same block), a slot costs once, and the tokens are the same."""
    from batchvlm.cache.specs import bytes_per_slot

    model, images, specs, want = encdec
    shared = EncDecToy(seed=6, shared_cache=True)
    assert 2 * bytes_per_slot(shared.state_specs()) == bytes_per_slot(model.state_specs())
    got, engine = _run(shared, images, specs, batch, pipelined)
    assert got == want
    paged = engine.runner.cache.paged
    assert paged["cross"].k is paged["self"].k and paged["cross"].v is paged["self"].v


def test_reference_attention_on_an_empty_prefix_is_own_attention():
    """A prefix of length 0 contributes nothing (it gave NaN before): prefix+own equals own."""
    from batchvlm.attention import (AttentionBatch, KVCache, Reads, SharedPrefix, TaskGroup, attend,
                                           plan_groups)

    g = torch.Generator().manual_seed(0)
    kv = KVCache(torch.zeros(1, 4 * 4, 2, 8), torch.zeros(1, 4 * 4, 2, 8), 4)
    q, k, v = (torch.randn(3, n, 8, generator=g) for n in (4, 2, 2))
    prefix = SharedPrefix(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                          torch.arange(3)[None], torch.arange(3)[:, None], 0, False)
    group = TaskGroup(torch.arange(3)[:, None], torch.zeros(3, 1, dtype=torch.long), torch.arange(1, 4)[:, None],
                      torch.ones(3, dtype=torch.long), prefix)
    batch = AttentionBatch(torch.tensor([4, 8, 12]), [group], 4)
    both = attend(q, k, v, kv.k[0], kv.v[0], batch, plan_groups(batch, kv))
    own = attend(q, k, v, kv.k[0], kv.v[0], batch, plan_groups(batch, kv), Reads.OWN)
    assert torch.isfinite(both).all() and torch.allclose(both, own)
