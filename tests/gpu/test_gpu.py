"""CUDA paths: streams, events, pinned staging, CUDA graphs, bf16. Skipped without CUDA."""

import json

import numpy as np
import pytest
import torch
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state, run_engine
from PIL import Image

from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's engines compile their own flex shapes: dynamo's per-process entries (limited, and
    an error when the limit is hit) are not shared between tests' configurations."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    folder = hub_folder(tmp_path_factory.mktemp("tiny"), TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder), device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(2)
    images = [Image.fromarray(torch.randint(0, 256, (50 + 31 * (i % 5), 70 + 23 * (i % 7), 3), generator=g,
                                            dtype=torch.uint8).numpy()) for i in range(24)]
    return md, [md.preprocessor(im) for im in images]


def test_graphs_pipelining_and_eager_agree_on_cuda(tiny_cuda):
    md, prepared = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    for graphs in (False, True):
        for pipelined in (False, True):
            for batch in (7, 64):
                got = run_engine(md, prepared, seqs, max_batch_size=batch, pipelined=pipelined, cuda_graphs=graphs)
                assert got == reference, (graphs, pipelined, batch)


def test_split_admission_steps_agree_with_the_mixed_step_on_cuda(tiny_cuda):
    """Admission steps as an eager prefill beside a graph replay of the decode rows (runner.py
    `_split`, the CUDA default) against one mixed eager forward: the same labels in float32."""
    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import Engine
    from batchvlm.job import EngineSpec

    md, prepared = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    for pipelined in (False, True):
        for batch in (7, 64):
            got = {}
            for split in (False, True):
                engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined), md.P)
                engine.runner.split_admission = split
                out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
                       for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
                got[split] = [out[i] for i in range(len(prepared))]
                assert (engine.stats["split_steps"] > 0) == split, engine.stats
            assert got[True] == got[False], (pipelined, batch)


def test_upstream_parity_on_cuda_float32(fixtures_dir, tmp_path):
    from support.moondream import upstream_tasks

    root = fixtures_dir / "moondream-tiny"
    config = json.loads((root / "config.json").read_text())
    folder = hub_folder(tmp_path / "m", config, root / "weights.safetensors", id_tokenizer(config["text"]["vocab_size"]))
    md = LoadedMoondream(str(folder), device="cuda", dtype="float32")
    expected = json.loads((root / "expected.json").read_text())
    prepared = [md.preprocessor(Image.open(root / "images" / e["file"])) for e in expected["images"]]
    seqs = md.sequences(upstream_tasks(expected), max_new_tokens=20, max_objects=5)
    got = run_engine(md, prepared, seqs, max_batch_size=64, pipelined=True, cuda_graphs=True)
    for e, (cap, query, det, pt) in zip(expected["images"], got):
        assert cap[0] == e["caption_normal"]["token_ids"] and query[0] == e["query"]["token_ids"]
        boxes = [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in e["detect"]["objects"]]
        assert np.allclose(np.array(det[1]).reshape(-1, 4), np.array(boxes).reshape(-1, 4), atol=1e-5)


def test_demo_model_in_bfloat16_still_labels_right():
    from batchvlm.shapes.evaluate import score_model

    md = LoadedMoondream("demo", device="cuda", dtype="bfloat16")
    scores = score_model(md.model, md.family.tokenizer, md.preprocessor, 48, seed=4242)
    assert min(scores.values()) >= 0.85, scores


def test_kv_cache_is_sized_from_free_memory(tiny_cuda, monkeypatch):
    import batchvlm.engine.sizing as sizing_mod
    from batchvlm.engine.engine import Engine
    from batchvlm.cache.specs import bytes_per_slot
    from batchvlm.engine.sizing import Sizer
    from batchvlm.job import EngineSpec

    md, _ = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    settings = EngineSpec(max_batch_size=8, kv_memory_fraction=0.5)
    roomy = Engine(md.engine, seqs, settings, md.P)
    wanted = roomy.stats["kv_blocks"]  # a tiny model on a big GPU: everything it asks for
    per_block = bytes_per_slot(md.engine.state_specs()) * settings.block_size
    reserve, rows = Sizer(md.engine, roomy.shape, roomy.settings, print).warmup_peak_bytes(8)
    assert reserve > 0 and rows == 8
    del roomy
    # The warm-up's reserve pinned to what it measured, free memory to it plus the wanted
    # blocks: at fraction 0.5 the engine must take exactly half of them.
    monkeypatch.setattr(Sizer, "warmup_peak_bytes", lambda self, n_rows: (reserve, n_rows))
    monkeypatch.setattr(sizing_mod, "available_bytes", lambda dev: reserve + wanted * per_block)
    tight = Engine(md.engine, seqs, settings, md.P)
    assert tight.stats["kv_blocks"] == max(2, wanted // 2) < wanted
    monkeypatch.setattr(sizing_mod, "available_bytes", lambda dev: reserve)
    with pytest.raises(RuntimeError, match="one image's KV cache"):
        Engine(md.engine, seqs, settings, md.P)


def test_emission_views_are_pinned_and_contiguous():
    from batchvlm.engine.staging import Staging

    slot = Staging(torch.device("cuda"), capacity=64, n_rows=10)
    for n in (1, 7, 10):
        ints, floats = slot.out_views(n)
        assert ints.is_contiguous() and floats.is_contiguous()
        assert ints.is_pinned() and floats.is_pinned()
        assert ints.data_ptr() == slot.out_ints.data_ptr() and floats.data_ptr() == slot.out_floats.data_ptr()


def test_graphs_are_captured_at_start_up_and_replayed(tiny_cuda):
    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import Engine
    from batchvlm.engine.graphs import buckets
    from batchvlm.job import EngineSpec

    md, prepared = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=32, pipelined=True), md.P)
    graphs = engine.runner.graphs
    assert set(graphs.graphs) == set(buckets(32)) and all(g[0] is not None for g in graphs.graphs.values())
    captured = dict(graphs.graphs)
    list(engine.run(Sample(0, i, str(i), p) for i, p in enumerate(prepared)))
    assert graphs.graphs == captured
    assert 0 < engine.stats["graph_steps"] < engine.stats["steps"], engine.stats


def test_engine_agrees_with_itself_in_bfloat16(tmp_path):
    """bf16 rounding depends on the batch composition, so runners may differ in a few sequences:
    most must agree, and each must be well formed."""
    folder = hub_folder(tmp_path / "tiny", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder), device="cuda", dtype="bfloat16")
    g = torch.Generator().manual_seed(7)
    images = [Image.fromarray(torch.randint(0, 256, (60 + 17 * i, 80, 3), generator=g, dtype=torch.uint8).numpy())
              for i in range(16)]
    prepared = [md.preprocessor(im) for im in images]
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    runs = [run_engine(md, prepared, seqs, max_batch_size=b, pipelined=p, cuda_graphs=gr)
            for b, p, gr in ((7, False, False), (64, True, True), (64, False, True))]
    for run in runs:
        for img in run:
            for (tokens, objects), s in zip(img, seqs):
                assert len(tokens) <= 9 and len(objects) <= 3
    pairs = [(a, b) for other in runs[1:] for x, y in zip(runs[0], other) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8


def test_vision_inputs_go_up_through_reused_pinned_buffers():
    from batchvlm.models.base.pinned import PinnedUpload

    up = PinnedUpload(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, 256, (n, 8, 8, 3), generator=g, dtype=torch.uint8) for n in sizes]
               for sizes in ([1, 13], [2], [13, 13, 1], [1], [5, 2])]
    outs = [up(parts) for parts in batches]  # later batches reuse (and overwrite) the buffers
    torch.cuda.synchronize()
    for parts, out in zip(batches, outs):
        assert out.is_cuda and torch.equal(out.cpu(), torch.cat(parts))
    assert all(b.is_pinned() for b in up._bufs)


def test_warm_up_halves_the_rows_until_the_largest_step_fits(tiny_cuda, monkeypatch):
    from batchvlm.engine.engine import Engine
    from batchvlm.engine.sizing import Sizer
    from batchvlm.job import EngineSpec

    md, prepared = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    real = Sizer.run_largest_step

    def fault(self, n_rows, *args):
        if n_rows > 12:
            raise torch.OutOfMemoryError("injected")
        return real(self, n_rows, *args)

    monkeypatch.setattr(Sizer, "run_largest_step", fault)
    logged = []
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=64), md.P, log=logged.append)
    assert engine.stats["rows"] == 8 and len(logged) == 3
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    from batchvlm.data.loader import Sample

    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 128)])
def test_compiled_fused_attention_equals_the_reference_on_cuda(dtype, heads, kv_heads, head_dim):
    """The compiled flex kernels (the CUDA default) at Triton-valid shapes: KV block 16, head dim
    64 (MHA) and 128 (GQA, 4 query heads per KV head), 1 / 8 queries per row (the decode kernel)
    and 128 (the main kernel), own and shared-prefix parts. dynamo starts clean and a fallback to
    the unfused path is an error (fail_on_recompile_limit_hit)."""
    from paged_step import paged_step  # scripts/: on the path by pyproject.toml

    from batchvlm.attention import KVCache, ReferenceAttention, attend, backend_for, plan_groups
    from batchvlm.attention.fused import FusedAttention

    torch._dynamo.reset()
    assert isinstance(backend_for(torch.device("cuda")), FusedAttention)
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-4
    for Tq in (1, 8, 128):
        batch, n_slots, _ = paged_step(4, 12, 100, own_max=140, bs=16, device="cuda", queries=Tq, seed=Tq)
        g = torch.Generator(device="cuda").manual_seed(Tq)
        k, v = (torch.randn(1, n_slots, kv_heads, head_dim, generator=g, device="cuda", dtype=dtype) for _ in range(2))
        N = batch.write_slots.shape[0]
        q, k_new, v_new = (torch.randn(N, h, head_dim, generator=g, device="cuda", dtype=dtype)
                           for h in (heads, kv_heads, kv_heads))
        outs = []
        for backend in (ReferenceAttention(), FusedAttention(compile=True)):
            cache = KVCache(k.clone(), v.clone(), 16, backend)
            with torch.inference_mode():
                outs.append(attend(q, k_new, v_new, cache.k[0], cache.v[0], batch, plan_groups(batch, cache)).float())
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_json_masks_on_cuda_agree_and_do_not_starve_the_device(tmp_path):
    """json and constrained detect on a random Qwen3-VL (transformers-written, widened so a step
    takes device time): synchronous eager steps and pipelined CUDA-graph steps give the same labels
    (the mask table is read inside the graphs), and a launch finds the previous step still running
    on the device about as often with masks as without (masks are computed while it runs)."""
    pytest.importorskip("transformers")
    pytest.importorskip("xgrammar")
    from support.qwen3vl_fixture import write_checkpoint
    from support.structured_cases import SCHEMAS
    from support.qwen_vl import images

    from batchvlm.data.decode import decode
    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import Engine
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import CaptionTask, DetectTask, JsonTask
    from support.inputs import encode_image

    folder = write_checkpoint(tmp_path / "qwen", seed=2, text_dim=512, heads=8, kv_heads=4, head_dim=64, layers=8,
                              section=(16, 8, 8))
    family = open_family(ModelSpec(name=str(folder)))
    model = family.load("float32", "cuda")
    pre = family.preprocessor()
    prepared = [pre(d.image, d.width, d.height) for d in
                (decode(encode_image(im, "PNG"), 10**8) for im in (images() * 4)[:24])]
    constrained = [JsonTask(json={"prompt": "Count.", "schema": SCHEMAS[n][0], "name": n}) for n in ("bounds", "arrays")]
    constrained.append(DetectTask(detect={"objects": ["cat"]}))
    free = [CaptionTask(caption={}), CaptionTask(caption={"length": "short", "name": "short"}),
            CaptionTask(caption={"length": "long", "name": "long"})]

    def run(tasks, pipelined: bool, graphs: bool):
        settings = EngineSpec(max_new_tokens=40, max_batch_size=64, pipelined=pipelined, cuda_graphs=graphs)
        seqs = family.sequences(tasks, settings, constrain=True)
        engine = Engine(model, seqs, settings, family.max_prefix_len())
        ahead: list[bool] = []  # per launch after the first: was the previous step still running?

        def launch(plan, launch=engine.runner.launch):
            if engine.inflight and engine.inflight[-1].slot.done is not None:
                ahead.append(not engine.inflight[-1].slot.done.query())  # a query, not a wait
            return launch(plan)

        engine.runner.launch = launch
        done = {im.sample.index: im for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared))}
        cols = [family.columns(tasks, seqs, [s.output for s in done[i].seqs]) for i in sorted(done)]
        return cols, (sum(ahead) / len(ahead) if ahead else 0.0)

    sync, _ = run(constrained, False, False)
    piped, json_ahead = run(constrained, True, True)
    assert piped == sync
    _, free_ahead = run(free, True, True)
    print(f"launches finding the previous step running: json {json_ahead:.0%}, free text {free_ahead:.0%}")
    assert json_ahead >= free_ahead - 0.1


# ---------------------------------------------------------------- the newer model paths on CUDA

def _labels(family, model, tasks, prepared, **engine) -> tuple[list[dict], dict]:
    """The finished columns of every image, and the engine's stats."""
    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import Engine
    from batchvlm.job import EngineSpec

    settings = EngineSpec(**engine)
    seqs = family.sequences(tasks, settings)
    eng = Engine(model, seqs, settings, family.max_prefix_len())
    done = {im.sample.index: im for im in eng.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared))}
    assert eng.scheduler.blocks.used == 0
    return [family.columns(tasks, seqs, [s.output for s in done[i].seqs]) for i in range(len(prepared))], eng.stats


def _same(a, b, tol: float) -> bool:
    """Equal labels; floats (classify probabilities, box corners) within tol."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    return a == b


def _share_same(x: list[dict], y: list[dict], tol: float) -> float:
    """Share of (image, column) labels that agree."""
    pairs = [(a[k], b.get(k)) for a, b in zip(x, y) for k in a]
    return sum(_same(p, q, tol) for p, q in pairs) / len(pairs)


def _case(name: str, folder):
    """(checkpoint, tasks, prepared images, CUDA dtype) of a newer model path."""
    from batchvlm.data.decode import decode
    from batchvlm.job import ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import ClassifyTask
    from support.inputs import encode_image

    classify = ClassifyTask(classify={"question": "What is it?", "choices": ["red", "red car", "reddish", "blue"]})
    if name == "florence2":
        from support.florence2 import TASKS as FLORENCE_TASKS
        from support.florence2 import random_images, tasks_of
        from support.tiny_vlms import florence2

        # head dim 64 (Triton-valid); the n-gram ban and a forced first token: the per-row token
        # history (RowState.row) and the prefixes' cross-attention K/V (CrossKV) in the graphs
        folder = florence2(folder, seed=1, text=dict(d_model=128, encoder_attention_heads=2, decoder_attention_heads=2,
                                                     encoder_ffn_dim=256, decoder_ffn_dim=256),
                           generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
        family = open_family(ModelSpec(name=str(folder)))
        pre = family.preprocessor()
        return family, tasks_of(FLORENCE_TASKS), [pre(im) for im in random_images(8, seed=3)], "float32"
    from support.qwen_vl import TASKS as QWEN_TASKS
    from support.qwen_vl import images

    if name == "qwen3_5":  # Gated DeltaNet state (float32) forked per task, classify's scored rows
        from support.qwen35_fixture import write_checkpoint

        folder = write_checkpoint(folder, seed=2, likely_stops=True, text_dim=256, heads=4, kv_heads=2, head_dim=64,
                                  section=(8, 4, 4))
        dtype = "float32"
    else:  # qwen3_vl_moe: the grouped-GEMM expert path (bfloat16) inside the graphs
        from support.qwen3vl_fixture import write_checkpoint

        folder = write_checkpoint(folder, seed=2, likely_stops=True, text_dim=256, heads=4, kv_heads=2, head_dim=64,
                                  section=(16, 8, 8), moe=dict(experts=8, top_k=2, ff=64))
        dtype = "bfloat16"
    family = open_family(ModelSpec(name=str(folder)))
    pre = family.preprocessor()
    prepared = [pre(d.image, d.width, d.height) for d in
                (decode(encode_image(im, "PNG"), 10**8) for im in (images() * 2)[:8])]
    return family, [*QWEN_TASKS, classify], prepared, dtype


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_vl_moe", "florence2"])
def test_newer_model_paths_in_cuda_graphs_agree_with_eager_steps_and_the_cpu(name, tmp_path, monkeypatch):
    """Qwen3.5 (recurrent state, classify), Qwen3-VL-MoE in bfloat16 (grouped GEMM) and Florence-2
    (CrossKV, the n-gram history): pipelined CUDA-graph runs against synchronous eager ones on CUDA
    (float32: the same labels; bfloat16: rounding follows the batch, most agree), and float32 CUDA
    against the CPU engine (which the CPU suite checks against transformers): a device mismatch or
    a stale static buffer would garble far more than the few near-ties float noise can flip."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # convolutions as on the CPU
    family, tasks, prepared, dtype = _case(name, tmp_path / name)
    model = family.load(dtype, "cuda")
    if name == "qwen3_vl_moe":
        from batchvlm.models.qwen_vl.moe import SparseMoE

        cap = torch.cuda.get_device_capability()
        paths = {m.path for m in model.model.modules() if isinstance(m, SparseMoE)}
        assert paths == {"grouped" if cap == (9, 0) or cap[0] == 10 else "gathered"}
    _graphs_agree_with_eager_and_the_cpu(name, family, model, tasks, prepared, dtype)


def _graphs_agree_with_eager_and_the_cpu(name: str, family, model, tasks, prepared, dtype: str) -> None:
    """Pipelined CUDA-graph runs against synchronous eager ones (float32: the same labels;
    bfloat16: most), and float32 eager ones against the CPU engine (most: kernels sum differently)."""
    eager, _ = _labels(family, model, tasks, prepared, max_new_tokens=12, max_batch_size=64, pipelined=False,
                       cuda_graphs=False)
    graphs, stats = _labels(family, model, tasks, prepared, max_new_tokens=12, max_batch_size=64, pipelined=True)
    assert 0 < stats["graph_steps"] < stats["steps"], stats
    if dtype == "bfloat16":
        assert _share_same(graphs, eager, 0.05) >= 0.8
        return
    assert all(_same(g, e, 1e-4) for g, e in zip(graphs, eager)), (graphs, eager)
    cpu, _ = _labels(family, family.load("float32", "cpu"), tasks, prepared, max_new_tokens=12, max_batch_size=64,
                     pipelined=False)
    share = _share_same(eager, cpu, 1e-3)
    print(f"{name}: {share:.0%} of the labels equal the CPU engine's")
    assert share >= 0.9


def test_florence2_pruned_on_cuda_agrees_with_eager_steps_and_the_cpu(tmp_path, monkeypatch):
    """Florence-2 with duplicate pruning (model.prune_duplicates) on CUDA: the kept cells' tokens
    gathered on the device and the encoder's positions with gaps, prefixes of differing lengths in
    the cross-attention K/V; pipelined CUDA-graph runs against synchronous eager ones (float32: the
    same labels), and against the CPU engine (which the CPU suite checks against transformers)."""
    pytest.importorskip("transformers")
    from batchvlm.job import ModelSpec
    from batchvlm.models.registry import open_family
    from support.florence2 import TASKS as FLORENCE_TASKS
    from support.florence2 import flat_images, tasks_of
    from support.tiny_vlms import florence2

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # convolutions as on the CPU
    folder = florence2(tmp_path / "f2", seed=1, text=dict(d_model=128, encoder_attention_heads=2,
                                                           decoder_attention_heads=2, encoder_ffn_dim=256,
                                                           decoder_ffn_dim=256),
                       generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
    family = open_family(ModelSpec(name=str(folder), prune_duplicates=0.0))
    prepared = [family.preprocessor()(im) for im in flat_images(64) * 2]
    assert sum(p.keep is not None for p in prepared) == 8  # the flat ones are pruned, the noise ones not
    tasks = tasks_of(FLORENCE_TASKS)
    model = family.load("float32", "cuda")
    _graphs_agree_with_eager_and_the_cpu("florence2 pruned", family, model, tasks, prepared, "float32")


def test_moe_grouped_gemm_equals_the_loop_and_replays_in_a_cuda_graph():
    """The expert path CUDA bfloat16 gets (grouped GEMM on sm_90 / sm_100, else the gathered one)
    against the float32 loop, and captured in a CUDA graph: a replay with new tokens (new routing,
    same shapes) equals an eager call."""
    from batchvlm.models.qwen_vl.config import MoEConfig
    from batchvlm.models.qwen_vl.moe import SparseMoE, path_for

    torch.manual_seed(0)
    ref = SparseMoE(256, MoEConfig(16, 4, 128, 0, ()))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    m = SparseMoE(256, MoEConfig(16, 4, 128, 0, ())).to("cuda", torch.bfloat16)
    m.load_state_dict(ref.state_dict())
    m.path = path_for(m, torch.device("cuda"), torch.bfloat16)
    ref = ref.to("cuda")
    xs = [torch.randn(300, 256, device="cuda") for _ in range(2)]
    with torch.inference_mode():
        ref.path = "loop"
        for x in xs:
            torch.testing.assert_close(m(x.bfloat16()).float(), ref(x), atol=3e-2, rtol=3e-2)
        static = xs[0].bfloat16()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(static)
        static.copy_(xs[1].bfloat16())
        graph.replay()
        torch.testing.assert_close(out, m(xs[1].bfloat16()), atol=0, rtol=0)


def test_siglip_image_batches_on_cuda_agree_with_the_cpu(tmp_path):
    """The image-level path's CUDA half: pinned uploads, results copied back under an event while the
    next batch runs (batches of 4 over NaFlex buckets), in float32 and bf16, against the CPU."""
    from types import SimpleNamespace

    from support.siglip_fixture import random_images, siglip2_checkpoint

    from batchvlm.engine.images import ImageLabeler
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import EmbedTask, SimilarityArgs, SimilarityTask

    family = open_family(ModelSpec(name=str(siglip2_checkpoint(tmp_path / "siglip2"))))
    tasks = [EmbedTask(), SimilarityTask(similarity=SimilarityArgs(text_column="txt"))]
    seqs = family.sequences(tasks, EngineSpec())
    images = random_images(11, seed=4)

    def run(device, dtype):
        model = family.load(dtype, device)
        pre = family.preprocessor()
        samples = [SimpleNamespace(key=str(i), prepared=pre(im), meta={"txt": f"photo {i}"})
                   for i, im in enumerate(images)]
        got = {s.key: family.columns(tasks, seqs, raws) for s, raws in
               ImageLabeler(model, seqs, EngineSpec(max_batch_size=4)).label(samples)}
        return [got[str(i)] for i in range(len(images))]

    cpu = run("cpu", "float32")
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        cuda = run("cuda", dtype)
        for a, b in zip(cpu, cuda):
            assert np.abs(np.array(a["embed"]) - np.array(b["embed"])).max() < tol
            assert abs(a["similarity"] - b["similarity"]) < tol


def test_fla_gated_delta_rule_equals_the_torch_path_on_cuda(monkeypatch):
    """Qwen3.5's Gated DeltaNet layer on flash-linear-attention's kernels (models/qwen3_5/fla_rule.py:
    chunked prefill over cu_seqlens, fused recurrent decode) against the torch path on the same
    CUDA inputs and states, at Qwen3.5-2B's linear-attention shapes: runs from zeros longer than a
    chunk, a run continuing from another's state, decode steps. fla's float32 dots may use TF32:
    a relative tolerance of 1e-2 on outputs and states."""
    from types import SimpleNamespace

    from batchvlm.cache.spans import ZERO
    from batchvlm.models.qwen3_5 import fla_rule
    from batchvlm.models.qwen3_5.linear_attention import GatedDeltaNet
    from batchvlm.models.qwen3_5.linear_state import Segments

    c = SimpleNamespace(dim=512, lin_k_heads=16, lin_v_heads=16, lin_k_dim=128, lin_v_dim=128, conv_kernel=4,
                        rms_eps=1e-6)
    c.conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
    torch.manual_seed(0)
    layer = GatedDeltaNet(c).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    lengths, reads, writes = [300, 17, 130], [ZERO, ZERO, 1], [0, 1, 2]
    starts = [0, 300, 317]
    steps = torch.tensor([0, 3, 2], device="cuda")
    x = torch.randn(sum(lengths) + len(steps), c.dim, device="cuda")

    def run(enabled: bool):
        monkeypatch.setattr(fla_rule, "ENABLED", enabled)
        g = torch.Generator(device="cuda").manual_seed(1)
        conv = torch.randn(4, c.conv_dim, c.conv_kernel - 1, device="cuda", generator=g)
        rec = torch.randn(4, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim, device="cuda", generator=g) * 0.05
        seg = Segments.of(starts, lengths, reads, writes, steps, sum(lengths), x.device)
        with torch.inference_mode():
            return layer(x, seg, conv, rec), conv, rec

    if not fla_rule.kernels(torch.device("cuda")):  # the carried wheels (scripts/gpu_wheels.sh) did not import
        pytest.skip("flash-linear-attention is not importable")
    want, got = run(False), run(True)
    for name, w, g in zip(("out", "conv", "recurrent"), want, got):
        err = ((g.float() - w.float()).norm() / w.float().norm()).item()
        assert err < 1e-2, (name, err)
