"""engine/images.py with a synthetic encoder-only model on CPU: every sample comes out exactly
once, batches hold one bucket's images and at most max_batch_size of them, no image waits behind
more than 2 x max_batch_size others, and an out-of-memory batch runs in halves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchvlm.engine.images import ImageLabeler
from batchvlm.job import EngineSpec
from batchvlm.models.base.decoding import RawOutput


class Toy:
    """Bucket = the prepared value // 10; each image's output is its own value; `fail_over`:
    a batch larger than this runs out of memory."""

    def __init__(self, fail_over: int | None = None):
        self.device = torch.device("cpu")
        self.info = None
        self.batches: list[tuple[int, list[int]]] = []
        self.fail_over = fail_over

    def start(self, seqs):
        self.seqs = seqs

    def bucket(self, image):
        return image // 10

    def run(self, samples, length):
        if self.fail_over is not None and len(samples) > self.fail_over:
            raise torch.OutOfMemoryError("toy")
        values = [s.prepared for s in samples]
        assert {self.bucket(v) for v in values} == {length}
        self.batches.append((length, values))
        return values

    def collect(self, handle):
        return [[RawOutput([], [(v,)])] for v in handle]


def samples(values):
    return [SimpleNamespace(key=str(i), prepared=v, meta=None) for i, v in enumerate(values)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_every_sample_once_in_bucketed_bounded_batches(batch):
    values = [(i * 37) % 50 for i in range(101)]  # five buckets, interleaved
    toy = Toy()
    out = list(ImageLabeler(toy, [], EngineSpec(max_batch_size=batch)).label(samples(values)))
    assert sorted(int(s.key) for s, _ in out) == list(range(len(values)))
    assert all(raws[0].objects == [(values[int(s.key)],)] for s, raws in out)
    assert all(1 <= len(b) <= batch for _, b in toy.batches)
    position = {s.key: n for n, (s, _) in enumerate(out)}
    for i in range(len(values)):  # an image comes out behind at most 3 x batch images that came in after it
        assert position[str(i)] <= i + 3 * batch


def test_an_out_of_memory_batch_runs_in_halves():
    toy = Toy(fail_over=2)
    labeler = ImageLabeler(toy, [], EngineSpec(max_batch_size=8))
    out = list(labeler.label(samples([5] * 20)))
    assert sorted(int(s.key) for s, _ in out) == list(range(20))
    assert max(len(b) for _, b in toy.batches) <= 2
    # 8 fails, then its first 4 (two halvings); its second 4 and later batches run as 2s, never failing again
    assert labeler.batch == 2 and labeler.stats["oom_halvings"] == 2


def test_a_bucket_filled_before_an_out_of_memory_runs_at_the_lowered_size():
    toy = Toy(fail_over=2)
    labeler = ImageLabeler(toy, [], EngineSpec(max_batch_size=8))
    out = list(labeler.label(samples([5, 15] * 10)))  # the 15s' bucket holds 7 when the 5s' 8 fail
    assert sorted(int(s.key) for s, _ in out) == list(range(20))
    assert max(len(b) for _, b in toy.batches) <= 2 and labeler.stats["oom_halvings"] == 2
