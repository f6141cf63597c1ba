"""Scheduler and KV block manager on CPU with synthetic requests: no model, no tensors."""

import random
from collections import deque

import numpy as np
import pytest

from batchvlm.cache.blocks import BlockManager, OutOfBlocks
from batchvlm.engine.plan import Emissions
from batchvlm.engine.scheduler import Scheduler
from batchvlm.data.loader import Sample
from batchvlm.engine.sequence import Prefix, Request, SeqState, Sequence
from batchvlm.models.base.decoding import EMIT_NONE, MODE_TEXT, SeqSpec
from batchvlm.models.moondream.grammar import MODE_DETECT, MODE_POINT, spec


def test_block_refcounts():
    bm = BlockManager(6, 4)
    a = bm.allocate(3)
    assert 0 not in a and bm.free == 2
    bm.share(a)
    bm.release(a)
    assert bm.free == 2
    bm.release(a)
    assert bm.free == 5
    with pytest.raises(OutOfBlocks):
        bm.allocate(6)
    with pytest.raises(ValueError):
        bm.release(a)


SPECS = [SeqSpec(MODE_TEXT, (1, 2, 3), 6), SeqSpec(MODE_TEXT, (1, 2, 3, 4, 5, 6, 7), 3),
         spec(MODE_DETECT, (1, 9, 3), 4), spec(MODE_POINT, (1, 10, 3), 2)]


def make_images(n: int, rng: random.Random, prefix_len: int | None = None) -> list[Request]:
    """Images with 1..all of SPECS; prefix lengths vary per image unless given."""
    images = []
    for i in range(n):
        image = Request(Sample(0, i, str(i), None), prefixes=[Prefix((), prefix_len or rng.randint(3, 24), 0)])
        specs = rng.sample(SPECS, rng.randint(1, len(SPECS)))
        image.seqs = [Sequence(image, image.prefixes[0], j, s, seed=0) for j, s in enumerate(specs)]
        images.append(image)
    return images


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_random_finishes_never_leak_or_overcommit(seed, pipelined, batched):
    rng = random.Random(seed)
    bs = 4
    n_rows = rng.choice([1, 3, 8])
    n_blocks = rng.choice([12, 20, 60])
    blocks = BlockManager(n_blocks, bs)
    # batched: admission waits for free rows, and the row cap is halved (after an out-of-memory) midway.
    sched = Scheduler(blocks, n_rows, n_feature_slots=3, admit_rows=rng.randint(1, n_rows) if batched else 1)
    images = make_images(12, rng)
    pending = deque(images)
    inflight: deque = deque()
    finished_at: dict[int, int] = {}
    returned = []
    step = 0
    while pending or not sched.idle or inflight:
        while pending and (slot := sched.take_feature_slot()) is not None:
            sched.add_encoded(pending.popleft(), slot)
        if batched and step == 5:
            sched.row_cap = max(1, n_rows // 2)
        plan = sched.schedule()
        if plan is not None:
            # Capacity: rows and blocks in use never exceed what exists.
            rows = [s.row for s in sched.running]
            assert len(rows) == len(set(rows)) <= n_rows
            assert len(plan.seqs) <= sched.row_cap
            assert blocks.used <= n_blocks - 1
            for s in plan.seqs:  # a sequence runs at most one step past its known finish
                assert step - finished_at.get(id(s), step) <= 1
            # The device finishes a sequence at random, and surely when its limit is reached.
            finished = np.array([rng.random() < 0.25 or s.decode_steps >= s.max_decode_steps for s in plan.seqs])
            n = len(plan.seqs)
            em = Emissions(np.full(n, EMIT_NONE), np.zeros(n, dtype=np.int64), finished, np.zeros((n, 2)))
            inflight.append((plan, em))
            step += 1
        if inflight and (not pipelined or len(inflight) == 2 or plan is None):
            p, em = inflight.popleft()
            for s, f in zip(p.seqs, em.finished):
                if f and s.state is SeqState.RUNNING:
                    finished_at[id(s)] = step
            for image in sched.commit(p, em):
                returned.append(image.sample.index)
                # Prefix blocks are held while any of the image's sequences is not retired.
                live = [s for s in image.seqs if s.state is not SeqState.RETIRED]
                for b in image.prefixes[0].blocks:
                    assert blocks.refs(b) == len(live)
        elif plan is None:
            assert sched.idle or pending, "stalled"
    assert sorted(returned) == list(range(12))
    assert blocks.free == n_blocks - 1 and blocks.used == 0
    assert sorted(sched.free_rows) == list(range(n_rows))
    assert all(s.state is SeqState.RETIRED for im in images for s in im.seqs)


def test_plan_holds_prefix_once_and_own_blocks_per_sequence():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, 8, n_feature_slots=2)
    image = make_images(1, random.Random(3), prefix_len=13)[0]
    image.seqs = [Sequence(image, image.prefixes[0], j, s, seed=0) for j, s in enumerate(SPECS)]
    sched.add_encoded(image, sched.take_feature_slot())
    plan = sched.schedule()
    assert plan.prefix_tables.shape == (1, 4)  # ceil(13 / 4) prefix blocks, once
    assert plan.prompt_image.tolist() == [0, 0, 0, 0]
    assert plan.prompt_tables.shape == (4, 2)  # own blocks in use: ceil(7 / 4)
    for b in image.prefixes[0].blocks:
        assert blocks.refs(b) == 4
    assert plan.needs.tolist() == [1, 1, 3, 3]  # text: token head; spatial: token + x


def test_split_plan_keeps_the_order_of_every_unit():
    from batchvlm.engine.split import split_plan, units

    blocks = BlockManager(200, 4)
    sched = Scheduler(blocks, 16, n_feature_slots=4)
    images = make_images(3, random.Random(5))
    for image in images[:2]:
        sched.add_encoded(image, sched.take_feature_slot())
    first = sched.schedule()
    n = len(first.seqs)
    sched.commit(first, Emissions(np.full(n, EMIT_NONE), np.zeros(n, dtype=np.int64), np.zeros(n, bool),
                                  np.zeros((n, 2))))
    sched.add_encoded(images[2], sched.take_feature_slot())
    plan = sched.schedule()  # a mixed step: one prefix, its prompts, the first images' decodes
    assert len(plan.prefix_features) == 1 and len(plan.new_rows) and len(plan.decode_rows)
    stack = [plan]
    leaves = []
    while stack:
        p = stack.pop()
        if units(p) == 1:
            leaves.append(p)
        else:
            a, b = split_plan(p)
            assert units(a) + units(b) == units(p) and units(a) and units(b)
            stack += [b, a]
    assert [s for leaf in leaves for s in leaf.seqs] == plan.seqs
    assert np.concatenate([leaf.needs for leaf in leaves]).tolist() == plan.needs.tolist()
    assert np.concatenate([leaf.prompt_tokens for leaf in leaves]).tolist() == plan.prompt_tokens.tolist()
    assert np.concatenate([leaf.decode_rows for leaf in leaves]).tolist() == plan.decode_rows.tolist()
    assert units(leaves[0]) == 1 and len(leaves[0].prefix_features) == 1  # the prefix comes first
