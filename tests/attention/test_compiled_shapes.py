"""flex_attention as CUDA runs it, checked on CPU. It compiles a bounded set of shapes: one engine
configuration stays within dynamo's default recompile limit (8 entries per code object) over the
KV-sizing warm-up, every CUDA-graph bucket and a real scheduler run, and running past the limit
is an error, never a silent unfused fallback. Counted on CPU with dynamo's eager backend: the
same tracing, guards and cache entries as inductor on CUDA, without the kernels. Its kernel tiles
fit every supported KV block size, and the job refuses other block sizes on CUDA before any work."""

import pytest
import torch
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state
from PIL import Image
from support.paged_batches import random_batch, run

from batchvlm.data.loader import Sample
from batchvlm.device import CUDA_BLOCK_SIZES, check_block_size
from batchvlm.engine.engine import Engine
from batchvlm.engine.graphs import buckets
from batchvlm.engine.sizing import Sizer
from batchvlm.job import EngineSpec, JobError
from batchvlm.attention import dispatch as attention
from batchvlm.attention.fused import COMPILED, FusedAttention, bucket
from batchvlm.attention.paged_mask import Q_BLOCK, flex_tiles
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def counted(monkeypatch):
    """Every KV cache from here on attends through flex compiled by dynamo (eager backend)."""
    torch._dynamo.reset()
    monkeypatch.setattr(attention, "backend_for", lambda device: FusedAttention(compile=True, backend="eager"))
    yield
    torch._dynamo.reset()


def test_one_engine_configuration_compiles_at_most_8_shapes(tmp_path, counted):
    folder = hub_folder(tmp_path / "tiny", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    g = torch.Generator().manual_seed(3)
    images = [Image.fromarray(torch.randint(0, 256, (40 + 37 * i, 60, 3), generator=g, dtype=torch.uint8).numpy())
              for i in range(3)]
    prepared = [md.preprocessor(im) for im in images]
    seqs = md.sequences(TASKS, max_new_tokens=3, max_objects=1)
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]

    before = COMPILED.shapes
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=6, pipelined=True), md.P)
    r = engine.runner
    # what CUDA's KV sizing runs first, on its own scratch cache
    Sizer(md.engine, engine.shape, engine.settings, print).run_largest_step(r.n_rows)
    warm_up = COMPILED.shapes - before
    # Every graph bucket's fixed-shape body, run once as capture runs it (under inference_mode).
    r.graphs = r.decode_graphs(capture=False)
    assert set(r.graphs.graphs) == set(buckets(r.n_rows))
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert [out[i] for i in range(len(prepared))] == reference
    assert r.graph_steps > 0 and engine.stats["steps"] > r.graph_steps  # both kinds of step ran
    shapes = COMPILED.shapes - before
    # own and prefix parts of decode and prompt steps: at most 4 per KV cache size (the warm-up's
    # scratch cache and the real one)
    assert 0 < warm_up <= 4 and shapes <= 8, (warm_up, shapes)
    assert engine.stats["compiled_shapes"] == shapes and engine.stats["compile_s"] > 0


def test_hitting_the_recompile_limit_raises(counted):
    backend = FusedAttention(compile=True, backend="eager")  # raises dynamo's limit to RECOMPILE_LIMIT
    batch, N = random_batch(0, False, n_pad_rows=0)  # prompt and decode groups, own and prefix parts: 4 shapes
    before = COMPILED.shapes  # process-wide: earlier tests compiled too
    with torch._dynamo.config.patch(recompile_limit=3), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        run(backend, batch, N, 0)
    assert 0 < COMPILED.shapes - before <= 3  # this call compiled, up to the limit, then raised


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_tiles_divide_every_supported_block_size(dtype):
    """The tiles flex_tiles passes fit inductor's kernels: BLOCK_N divides the KV block, BLOCK_M the
    mask's query block, the decode kernel's query tile (queries x group heads, >= 16) divides it
    too, and no tile is larger than inductor's own sm_90 default (so it fits in shared memory)."""
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    h100 = CUDAConfigHeuristic().h100_default_flex_config
    for bs in CUDA_BLOCK_SIZES:
        for head_dim in (64, 128, 256):  # 256: Qwen3.5's full-attention layers
            for n in (1, 2, 8, 16, 64, 127, 128, 256, 1024):
                for group in (1, 2, 4, 8, 3, 7):
                    q_block, opts = flex_tiles(bs, dtype, head_dim, n, group)
                    assert bs % opts["BLOCK_N"] == 0 and opts["BLOCK_N"] >= 16
                    if n < 128 and group & (group - 1) == 0:  # the decode kernel picks its BLOCK_M
                        assert "BLOCK_M" not in opts and q_block % max(16, bucket(n * group)) == 0
                        assert opts["BLOCK_N"] <= 64
                    else:
                        default = h100[(dtype, head_dim)]
                        assert q_block == Q_BLOCK and Q_BLOCK % opts["BLOCK_M"] == 0
                        assert opts["BLOCK_M"] <= default.block_m and opts["BLOCK_N"] <= default.block_n
                        assert opts.get("FORCE_USE_FLEX_ATTENTION", False) == (group & (group - 1) != 0)


def test_cuda_block_sizes_are_checked_before_any_work():
    for bs in CUDA_BLOCK_SIZES:
        check_block_size(EngineSpec(block_size=bs), "cuda")
    check_block_size(EngineSpec(block_size=4), "cpu")  # the reference attention takes any size
    with pytest.raises(JobError, match=r"^engine.block_size: 8 on CUDA; use one of 16, 32, 64, 128"):
        check_block_size(EngineSpec(block_size=8), "cuda")
