"""The engine's device-side bookkeeping, checked on CPU: vision events per batch, contiguous
emission views, graph buckets captured at start-up, memory-bounded KV sizing, and steps that run
out of memory finishing in halves with every row written."""

import numpy as np
import pytest
import torch
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state
from PIL import Image

import batchvlm.engine.engine as engine_mod
import batchvlm.engine.runner as runner_mod
import batchvlm.engine.sizing as sizing_mod
from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.engine.graphs import DecodeGraphs, buckets, key_of
from batchvlm.engine.runner import Runner
from batchvlm.engine.staging import Staging
from batchvlm.cache.specs import bytes_per_slot
from batchvlm.job import EngineSpec
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = hub_folder(tmp_path_factory.mktemp("tiny"), TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    g = torch.Generator().manual_seed(3)
    images = [Image.fromarray(torch.randint(0, 256, (40 + 37 * (i % 5), 60 + 29 * (i % 3), 3), generator=g,
                                            dtype=torch.uint8).numpy()) for i in range(6)]
    prepared = [md.preprocessor(im) for im in images]
    seqs = md.sequences(TASKS, max_new_tokens=6, max_objects=2)
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    return md, prepared, seqs, reference


def test_emission_views_are_contiguous_and_backed_by_the_slot():
    slot = Staging(torch.device("cpu"), capacity=64, n_rows=10)
    for n in (1, 3, 10):
        ints, floats = slot.out_views(n)
        assert ints.shape == (3, n) and floats.shape == (n, 2)
        assert ints.is_contiguous() and floats.is_contiguous()
        assert ints.data_ptr() == slot.out_ints.data_ptr() and floats.data_ptr() == slot.out_floats.data_ptr()
        assert ints.untyped_storage().data_ptr() == slot.out_ints.untyped_storage().data_ptr()
    assert not slot.pinned and not slot.out_ints.is_pinned()  # pinned on CUDA only (tests/gpu/test_gpu.py)


def test_each_vision_batch_has_its_event_and_a_prefill_waits_only_on_its_own(tiny):
    md, prepared, seqs, _ = tiny
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=8, max_images_in_flight=4), md.P)
    v = engine.runner.vision
    v.encode(prepared[:2], [0, 1])
    v.encode(prepared[2:3], [2])
    e = v.events
    assert e[0] is e[1] and e[2] is not e[0] and e[3] is None
    assert v.features[0] is not v.features[1] and v.features[0].shape == v.features[2].shape
    assert v.waits(np.array([2])) == [e[2]]  # not the older batch
    assert v.waits(np.array([1, 0])) == [e[0]]  # one wait per batch, not per image
    assert v.waits(np.array([0, 2, 1])) == [e[0], e[2]]
    assert v.waits(np.array([3])) == []


def test_prefilled_slots_release_their_features_and_events(tiny):
    md, prepared, seqs, _ = tiny
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=64, max_images_in_flight=4), md.P)
    r = engine.runner
    seen = []
    launch = r.launch

    def spy(plan):
        seen.append((plan.prefix_features.tolist(), [r.vision.events[s] for s in plan.prefix_features.tolist()]))
        return launch(plan)

    r.launch = spy
    done = [im.sample for im in engine.run(Sample(0, i, str(i), p) for i, p in enumerate(prepared))]
    assert sorted(s.index for s in done) == list(range(len(prepared)))
    assert all(s.prepared is None for s in done)  # the engine dropped the pixels once encoded
    prefills = [(slots, events) for slots, events in seen if slots]
    assert sum(len(slots) for slots, _ in prefills) == len(prepared)
    assert all(ev is not None for _, events in prefills for ev in events)
    assert r.vision.features == [None] * 4 and r.vision.events == [None] * 4


def test_graph_buckets_cover_every_decode_step():
    for n_rows in (1, 7, 64, 256):
        keys = set(buckets(n_rows))
        for D in range(1, n_rows + 1):
            for images in {1, D // 2 or 1, D}:
                assert key_of(D, images, n_rows) in keys
    assert len(buckets(256)) == 45


def test_graph_buckets_are_built_at_start_up_and_used_by_decode_steps(tiny):
    md, prepared, seqs, reference = tiny
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=16), md.P)
    r = engine.runner
    r.graphs = r.decode_graphs(capture=False)
    built = dict(r.graphs.graphs)
    assert set(built) == set(buckets(16))
    engine.scheduler.admit_rows = 4  # as with CUDA graphs: admit in batches
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference
    assert r.graphs.graphs == built  # nothing captured mid-run
    assert 0 < engine.stats["graph_steps"] < engine.stats["steps"]
    assert "replayed a CUDA graph" in engine.summary()


def test_a_held_emission_survives_the_next_graph_step(tiny, monkeypatch):
    """A replay rewrites its outputs (graphs.py): the emissions the copy stream reads after the
    next step is launched must be the step's own tensors. The uncaptured body keeps a replay's
    fixed output buffers, so on the CPU an alias would change under the held copy."""
    md, prepared, seqs, reference = tiny
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=16), md.P)
    r = engine.runner
    r.graphs = r.decode_graphs(capture=False)
    outputs = [out for _, _, out in r.graphs.graphs.values()]
    assert all(out.value.dtype == torch.float32 for out in outputs)  # `.float()` would be a view
    held, emitted = [], runner_mod.emitted

    def spy(d, n):
        ints, floats = emitted(d, n)
        held.append((ints, floats, ints.clone(), floats.clone()))
        return ints, floats

    monkeypatch.setattr(runner_mod, "emitted", spy, raising=True)
    engine.scheduler.admit_rows = 4
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference
    assert engine.stats["graph_steps"] > 1
    for ints, floats, ints0, floats0 in held:
        assert torch.equal(ints, ints0) and torch.equal(floats, floats0)
        for o in outputs:
            assert floats.untyped_storage().data_ptr() != o.value.untyped_storage().data_ptr()


def test_batched_admission_raises_the_share_of_decode_only_steps(tiny):
    md, prepared, seqs, reference = tiny
    shares = []
    for admit in (1, 8):
        engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=16), md.P)
        engine.scheduler.admit_rows = admit
        decode_only = []
        schedule = engine.scheduler.schedule

        def spy():
            plan = schedule()
            if plan is not None:
                decode_only.append(plan.is_decode_only)
            return plan

        engine.scheduler.schedule = spy
        out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
               for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
        assert [out[i] for i in range(len(prepared))] == reference
        shares.append(sum(decode_only) / len(decode_only))
    assert shares[1] > shares[0], shares


def test_cpu_kv_cache_is_bounded_by_available_memory(tiny, monkeypatch):
    md, _, seqs, _ = tiny
    per_block = bytes_per_slot(md.engine.state_specs()) * 16
    unbounded = Engine(md.engine, seqs, EngineSpec(max_batch_size=64), md.P)
    assert unbounded.stats["rows"] == 64
    monkeypatch.setattr(sizing_mod, "available_bytes", lambda device: 40 * per_block)
    bounded = Engine(md.engine, seqs, EngineSpec(max_batch_size=16384, kv_memory_fraction=0.5), md.P)
    assert bounded.stats["kv_blocks"] == 20
    assert bounded.runner.cache.n_blocks == 20
    assert 1 <= bounded.stats["rows"] < 20  # rows follow the blocks, not max_batch_size
    monkeypatch.setattr(sizing_mod, "available_bytes", lambda device: 2 * per_block)
    with pytest.raises(RuntimeError, match="not enough cpu memory for one image's KV cache"):
        Engine(md.engine, seqs, EngineSpec(), md.P)


def test_cpu_kv_cache_is_sized_from_the_job_not_host_memory(tiny, monkeypatch):
    """However much host memory there is, a CPU engine's cache holds what the job can use at
    once: every row's sequence at its longest, and the prefixes of the images those rows hold
    plus the one admitted as they turn over (issue 40 item 17). Its bytes are in the stats."""
    md, prepared, seqs, reference = tiny
    monkeypatch.setattr(sizing_mod, "available_bytes", lambda device: 1 << 40)
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=8), md.P)
    shape, rows = engine.shape, engine.stats["rows"]
    prefix = shape.prefix_blocks * shape.prefixes_per_image
    at_once = 1 + (shape.images_for(rows) + 1) * prefix + rows * shape.max_own_blocks
    assert engine.stats["kv_blocks"] == at_once and engine.stats["kv_sized_by"] == "job"
    per_block = bytes_per_slot(md.engine.state_specs()) * shape.block_size
    assert engine.stats["kv_mib"] == round(at_once * per_block / 2**20, 1)
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference


@pytest.mark.parametrize("pipelined", [False, True])
def test_out_of_memory_steps_run_in_halves_and_lose_no_row(tiny, pipelined):
    md, prepared, seqs, reference = tiny
    logged = []
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=32, pipelined=pipelined), md.P, log=logged.append)
    r = engine.runner
    eager = r._eager
    failed = []

    def fault(plan, slot):  # the device "runs out of memory" above 5 units of work
        work = len(plan.prefix_features) + len(plan.new_rows) + len(plan.decode_rows)
        if work > 5:
            failed.append(work)
            raise torch.OutOfMemoryError("injected")
        return eager(plan, slot)

    r._eager = fault
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference  # every row, every label
    assert engine.scheduler.blocks.used == 0
    assert failed and engine.stats["oom_halvings"] >= 1
    assert engine.scheduler.row_cap < 32
    assert any("out of accelerator memory" in m for m in logged)


def test_vision_upload_on_cpu_is_one_concatenation():
    from batchvlm.models.base.pinned import PinnedUpload

    parts = [torch.arange(12, dtype=torch.uint8).view(2, 2, 3), torch.zeros(1, 2, 3, dtype=torch.uint8)]
    out = PinnedUpload(torch.device("cpu"))(parts)
    assert torch.equal(out, torch.cat(parts)) and out.shape == (3, 2, 3)


@pytest.mark.parametrize("batch,prefill", [(3, 4096), (40, 4096), (40, 30)])
def test_the_warm_up_runs_the_largest_mixed_step(tiny, batch, prefill):
    """The KV sizing warm-up (CUDA) runs this step: prefixes, prompts attending their shared
    prefix, and decode rows at their longest, every head. Here it must simply run and emit."""
    from batchvlm.engine.warmup import largest_step

    md, _, seqs, _ = tiny
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=batch), md.P)
    plan = largest_step(batch, len(seqs), md.P, max(len(s.spec.prompt) for s in seqs),
                        max(len(s.spec.prompt) + s.spec.budget for s in seqs), 16, prefill)
    assert plan.n_out == batch and len(plan.prefix_features) >= 1
    assert len(plan.decode_rows) == (batch - len(seqs) if prefill < 2 * md.P else 0)
    d = sizing_mod.Sizer(md.engine, engine.shape, engine.settings, print).run_largest_step(batch, prefill)
    assert d.code.shape == (batch,) and d.value.shape == (batch, 2)


def test_a_vision_batch_never_outgrows_the_warm_up(tiny, monkeypatch):
    """The KV-sizing warm-up measures a vision batch of MAX_VISION_COST; an image that would push a
    batch past it waits for the next batch (and is labelled like every other)."""
    md, prepared, seqs, reference = tiny
    monkeypatch.setattr(engine_mod, "MAX_VISION_COST", 3)
    costs = [p.cost for p in prepared]
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=64), md.P)
    batches = []
    encode = engine.runner.vision.encode
    monkeypatch.setattr(engine.runner.vision, "encode",
                        lambda images, slots: (batches.append([p.cost for p in images]), encode(images, slots)))
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference
    assert sorted(c for b in batches for c in b) == sorted(costs) and max(costs) > 1
    assert all(sum(b) <= 3 or len(b) == 1 for b in batches), batches


def test_out_of_memory_in_vision_or_graph_capture_still_labels_everything(tiny, monkeypatch):
    """A vision batch that runs out of memory is encoded in halves; graph capture that runs out of
    memory leaves an engine that steps eagerly (and says so). Labels are unchanged either way."""
    md, prepared, seqs, reference = tiny
    encode, sizes = md.engine.encode, []

    def tight_encode(images):
        sizes.append(len(images))
        if len(images) > 1:
            raise torch.OutOfMemoryError("injected")
        return encode(images)

    monkeypatch.setattr(md.engine, "encode", tight_encode)

    def capture_fails(self, *args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(DecodeGraphs, "__init__", capture_fails)
    monkeypatch.setattr(Runner, "__init__", _graphs_forced(Runner.__init__))
    logged = []
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=16), md.P, log=logged.append)
    assert engine.runner.graphs is None and any("capturing CUDA graphs" in m for m in logged)
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference
    assert max(sizes) > 1 and sizes.count(1) == len(prepared)


def _graphs_forced(init):
    """Runner.__init__ that builds DecodeGraphs whenever graphs are asked for (CPU has none)."""
    def wrapped(self, *args):
        init(self, *args)
        if args[7]:  # cuda_graphs (after model, cache, rows, feature slots, prefix len, own blocks, seqs)
            self.graphs = self.decode_graphs()
    return wrapped
