"""Florence-2, native, against transformers' Florence2ForConditionalGeneration on two tiny random
checkpoints built here: (a) two DaViT stages, one safetensors file; (b) three stages with windows
that need padding, scaled embeddings, sharded safetensors, and a generation config that forces the
first token and bans repeated trigrams. Float32, greedy (num_beams=1), transformers' generate is
the reference (one batched call per prompt over the images: one prompt, nothing padded); pixel
values must be equal, encoder output and logits within float32 tolerance, the engine's greedy tokens identical at batch 1 / 5 / 32, pipelined and synchronous (and through the
fixed-shape decode body of CUDA graphs), and the CLI must write the transformers backend's labels.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from support.cli import cli_app
from support.florence2 import NEW_TOKENS, TASKS, Reference, random_images, tasks_of, tf

from batchvlm.data.loader import Sample
from batchvlm.engine import memory
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base import grounding
from batchvlm.models.base.errors import FamilyError
from batchvlm.models.florence2 import prompts
from batchvlm.models.registry import open_family
from support.tiny_vlms import florence2

TEXTS = ["<CAPTION>", "What is it?", "<OPEN_VOCABULARY_DETECTION>car", "<OPEN_VOCABULARY_DETECTION>dog", "<OCR>",
         "<DENSE_REGION_CAPTION>"]  # what the processor gets for each sequence of TASKS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tf()
    root = tmp_path_factory.mktemp("florence2")
    b = florence2(root / "b", seed=1, side=88, shard="60KB",
                  text=dict(d_model=48, encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=3,
                            encoder_ffn_dim=96, decoder_ffn_dim=96, scale_embedding=True),
                  vision=dict(depths=[1, 1, 1], patch_size=[7, 3, 3], patch_stride=[4, 2, 2], patch_padding=[3, 1, 1],
                              patch_prenorm=[False, True, True], embed_dim=[16, 24, 32], num_heads=[1, 2, 2],
                              num_groups=[1, 2, 4], window_size=3),
                  generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
    return {"a": florence2(root / "a"), "b": b}


@pytest.fixture(scope="module")
def refs(checkpoints) -> dict[str, Reference]:
    return {k: Reference(v) for k, v in checkpoints.items()}


def test_prompts_are_the_processors(checkpoints, refs):
    proc = refs["a"].processor
    assert prompts.INSTRUCTIONS == proc.task_prompts_without_inputs
    assert prompts.INSTRUCTIONS_WITH_INPUT == proc.task_prompts_with_input
    family = open_family(ModelSpec(name=str(checkpoints["a"])))
    assert (family.name, family.backend) == ("florence2", "native")
    seqs = family.sequences(tasks_of(TASKS), EngineSpec())
    image = random_images(1)[0]
    for seq, text in zip(seqs, TEXTS, strict=True):
        ids = refs["a"].inputs(image, text)["input_ids"][0].tolist()
        assert ids[: family.image_tokens] == [family.config.image_token_id] * family.image_tokens
        assert list(seq.spec.prefix_prompt) == ids[family.image_tokens:], text
    with pytest.raises(FamilyError, match=r"^tasks\.1\.point: Florence-2 cannot do point tasks"):
        family.sequences(tasks_of([{"caption": {}}, {"point": {"objects": ["a"]}}]), EngineSpec())
    with pytest.raises(FamilyError, match=r"^tasks\.0\.ocr: Moondream cannot do ocr tasks"):
        open_family(ModelSpec(name="demo")).sequences(tasks_of([{"ocr": {}}]), EngineSpec())
    hf = open_family(ModelSpec(name=str(checkpoints["a"]), backend="transformers"))
    assert [p.spec.text for p in hf.sequences(tasks_of(TASKS), EngineSpec())] == TEXTS  # the one mapping


def test_qwen3_vl_reads_text_by_prompt_and_refuses_regions(tmp_path):
    from support.qwen3vl_fixture import write_checkpoint

    family = open_family(ModelSpec(name=str(write_checkpoint(tmp_path / "q"))))
    (seq,) = family.sequences(tasks_of([{"ocr": {}}]), EngineSpec())
    assert family.tokenizer.decode(list(seq.spec.prompt)).startswith("Read all the text in the image.")
    with pytest.raises(FamilyError, match=r"^tasks\.1\.regions: Qwen3-VL cannot do regions tasks"):
        family.sequences(tasks_of([{"ocr": {}}, {"regions": {}}]), EngineSpec())


@pytest.mark.parametrize("name", ["a", "b"])
def test_pixels_encoder_and_logits_match_transformers(checkpoints, refs, name):
    family = open_family(ModelSpec(name=str(checkpoints[name])))
    model = family.load("float32", "cpu").model
    ref, pre = refs[name], family.preprocessor()
    with torch.inference_mode():
        for image, text in zip(random_images(3, seed=7), ["<CAPTION>", "<DENSE_REGION_CAPTION>", "Is it red?"]):
            enc = ref.inputs(image, text)
            pixels = model.pixel_values(pre(image).pixels[None])
            assert torch.equal(pixels, enc["pixel_values"])  # uint8 shipped, normalized on the device
            tokens = model.image_tokens(pixels)
            want_tokens = ref.model.model.get_image_features(enc["pixel_values"]).pooler_output
            torch.testing.assert_close(tokens, want_tokens, rtol=1e-5, atol=1e-5)
            prompt = enc["input_ids"][:, family.image_tokens:]
            out = model.encode(tokens, prompt)
            decoded = ref.model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS)
            want = ref.model(**enc, decoder_input_ids=decoded)
            torch.testing.assert_close(out, want.encoder_last_hidden_state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.dense_logits(decoded, out), want.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["a", "b"])
def test_vision_in_chunks_matches_transformers(checkpoints, refs, name, monkeypatch):
    """On the CPU the vision tower's attention and MLP run in chunks (vision.py); the tiny configs
    fit in one, so here a chunk is 1024 values (32-64 cells): several slices of bands, images and
    rows, an uneven last one in (b). Three images in one batch, as the engine encodes them."""
    from batchvlm.models.florence2 import vision

    family = open_family(ModelSpec(name=str(checkpoints[name])))
    model, pre = family.load("float32", "cpu").model, family.preprocessor()
    images = random_images(3, seed=5)
    with torch.inference_mode():
        pixels = model.pixel_values(torch.stack([pre(im).pixels for im in images]))
        want = refs[name].model.model.get_image_features(pixels).pooler_output
        monkeypatch.setattr(vision, "CHUNK_VALUES", 1024)
        torch.testing.assert_close(model.image_tokens(pixels), want, rtol=1e-5, atol=1e-5)


N_IMAGES = 8  # more sequences than the largest batch's rows: rows are reused, images queue


@pytest.fixture(scope="module")
def greedy(checkpoints, refs) -> dict[str, tuple]:
    """Per checkpoint: the loaded family, prepared images and transformers' greedy tokens."""
    out = {}
    for name, folder in checkpoints.items():
        family = open_family(ModelSpec(name=str(folder)))
        images = random_images(N_IMAGES, seed=3)
        by_text = [refs[name].generate(images, text) for text in TEXTS]
        want = [[by_text[t][i] for t in range(len(TEXTS))] for i in range(len(images))]
        assert len({w for ws in want for w in ws}) > len(TEXTS)  # answers differ by image: the image matters
        pre = family.preprocessor()
        out[name] = family, family.load("float32", "cpu"), [pre(im) for im in images], want
    return out


def run_engine(family, model, prepared, batch: int, pipelined: bool, fixed_shape_decode: bool = False):
    settings = EngineSpec(max_new_tokens=NEW_TOKENS, max_batch_size=batch, pipelined=pipelined)
    engine = Engine(model, family.sequences(tasks_of(TASKS), settings), settings, family.max_prefix_len())
    if fixed_shape_decode:  # the CUDA-graph decode body (padding, scratch row, null block), uncaptured
        r = engine.runner
        r.graphs = r.decode_graphs(capture=False)
    got = {im.sample.index: [s.output for s in im.seqs] for im in engine.run(Sample(0, i, f"k{i}", p)
                                                                         for i, p in enumerate(prepared))}
    assert engine.scheduler.blocks.used == 0 and len(engine.scheduler.free_rows) == engine.runner.n_rows
    return [got[i] for i in range(len(prepared))], engine


@pytest.mark.parametrize("name", ["a", "b"])
@pytest.mark.parametrize("batch, pipelined", [(1, False), (5, True), (32, False), (32, True)])
def test_engine_greedy_tokens_equal_batch_1_generate(greedy, name, batch, pipelined):
    family, model, prepared, want = greedy[name]
    n = 2 if batch == 1 else N_IMAGES  # one sequence at a time: two images (12 sequences) suffice
    got, engine = run_engine(family, model, prepared[:n], batch, pipelined, fixed_shape_decode=batch == 5)
    assert [[tuple(r.tokens) for r in img] for img in got] == want[:n]
    # One vision pass per image, shared by its six sequences (five distinct prompts' prefixes).
    assert engine.stats["vision_images"] == n
    # Both checkpoints force the end token: a cut answer is one the limit ended by writing it
    # (one token short of the limit).
    cuts = [r for img in got for r in img if r.cut]
    assert cuts and all(len(r.tokens) == NEW_TOKENS - 1 for r in cuts)


def test_loc_parsing_matches_the_processor(refs):
    proc = refs["a"].processor
    proc.post_processor.parse_task_config = {k: {} for k in ("pure_text", "description_with_bboxes",
                                                             "description_with_polygons",
                                                             "description_with_bboxes_or_polygons")}
    rng = random.Random(0)
    pieces = ["car", " a red car", "door ", "\u00e9", "<loc>", "<loc>", "<loc>", "<loc>", "<loc>", "<poly>", "</poly>",
              "<sep>", "<s>", "</s>", " ", "<od>"]
    size, seen = 10_000, 0
    for _ in range(1500):
        text = "".join(p.replace("<loc>", f"<loc_{rng.randrange(1000)}>") for p in rng.choices(pieces, k=rng.randrange(24)))
        regions = proc.post_process_generation(text, task="<DENSE_REGION_CAPTION>", image_size=(size, size))
        regions = regions["<DENSE_REGION_CAPTION>"]
        got = [(label, [round(v * size) for v in box]) for label, box in grounding.florence2_regions(text)]
        assert got == [(label, [min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3])])
                       for label, b in zip(regions["labels"], regions["bboxes"])], text
        detect = proc.post_process_generation(text, task="<OPEN_VOCABULARY_DETECTION>", image_size=(size, size))
        detect = detect["<OPEN_VOCABULARY_DETECTION>"]
        want = [[min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3])] for b in detect["bboxes"]]
        for polygons in detect["polygons"]:
            xy = [c for polygon in polygons for c in polygon]
            if xy:
                want.append([min(xy[0::2]), min(xy[1::2]), max(xy[0::2]), max(xy[1::2])])
        assert [[round(v * size) for v in box] for box in grounding.florence2_boxes(text)] == want, text
        seen += bool(want) + bool(got)
    assert seen > 200  # the texts above hold enough objects to compare


def test_cli_native_labels_equal_the_transformers_backend(tmp_path, checkpoints):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, im in enumerate(random_images(3, seed=11)):
        im.save(folder / f"im{i}.png")
    tables = {}
    for backend in ("auto", "transformers"):
        job = {"name": "f2", "input": {"folder": "imgs"}, "model": {"name": str(checkpoints["b"]), "backend": backend},
               "tasks": TASKS, "engine": {"max_new_tokens": NEW_TOKENS, "max_batch_size": 12},
               "loader": {"workers": 0}, "output": {"dir": f"out-{backend}", "raw_text": True}}
        (tmp_path / f"{backend}.yaml").write_text(yaml.safe_dump(job))
        cli_app(tmp_path, "run", tmp_path / f"{backend}.yaml", check=True)  # in this process: transformers imported once
        table = pq.read_table(tmp_path / f"out-{backend}")
        meta = json.loads(table.schema.metadata[b"batchvlm"])
        assert (meta["model"]["family"], meta["model"]["backend"]) == (
            ("florence2", "native") if backend == "auto" else ("florence2", "transformers"))
        tables[backend] = sorted(table.drop_columns(["source"]).to_pylist(), key=lambda row: row["key"])
    native, hf = tables["auto"], tables["transformers"]
    assert [row["status"] for row in native] == ["ok"] * 3
    assert native == hf
    assert any(row["regions"] or row["detect"] for row in native)  # boxes were written and compared


def spy_launches(engine: Engine, after) -> None:
    """Call `after(plan)` after each step the engine launches (the step itself is untouched)."""
    launch = engine.runner.launch

    def spied(plan):
        inflight = launch(plan)
        after(plan)
        return inflight

    engine.runner.launch = spied


def test_a_prefill_step_ends_the_prefix_view(greedy):
    """One row: each image's caption prefix is prefilled (a step with no decode row) into the
    block the last image's prefix held, so its decode steps' prefix tables and lengths are
    byte-equal to the last image's. Only the prefill ending the view (runner.py `_prefix_view`)
    keeps the last image's cross-attention K/V copies from being read again; before it did so
    in steps without decode rows, the second image's caption came out wrong."""
    family, model, prepared, want = greedy["a"]
    n = 3
    assert len({want[i][0] for i in range(n)}) == n  # the captions differ by image
    settings = EngineSpec(max_new_tokens=NEW_TOKENS, max_batch_size=1, block_size=128)  # one-block prefixes
    engine = Engine(model, family.sequences(tasks_of(TASKS[:1]), settings), settings, family.max_prefix_len())
    assert engine.shape.max_prefix_len <= settings.block_size
    steps: list[tuple[bool, bytes]] = []  # (prefills, the decode group's prefix tables and lengths)
    spy_launches(engine, lambda p: steps.append((len(p.prefix_features) > 0, p.decode_image_tables.tobytes()
                                                 + p.decode_image_lens.tobytes())))
    got = {im.sample.index: im.seqs[0].output.tokens for im in engine.run(Sample(0, i, f"k{i}", p)
                                                                     for i, p in enumerate(prepared[:n]))}
    assert [tuple(got[i]) for i in range(n)] == [want[i][0] for i in range(n)]
    prefills = [i for i, (pre, _) in enumerate(steps) if pre]
    assert len(prefills) == n and all(not steps[i][1] for i in prefills)  # prefill-only steps
    decode_keys = {key for pre, key in steps if not pre}
    assert len(decode_keys) == 1  # every image's decode steps read the same blocks


def test_cpu_kv_sizing_reserves_the_largest_prefix_view(greedy, tmp_path, monkeypatch):
    """On CPU (the reference attention) the KV cache is sized from available memory less the most
    the decode group's PrefixView can hold (sizing.py `_prefix_view_bytes`), outside the cache:
    what it holds once every row decodes, each on its own prefix of the longest length. When not
    even one image's cache fits beside the rows' copies, the rows halve."""
    family, model, prepared, want = greedy["a"]
    n = 4
    settings = EngineSpec(max_new_tokens=NEW_TOKENS, max_batch_size=n)
    engine = Engine(model, family.sequences(tasks_of(TASKS[:1]), settings), settings, family.max_prefix_len())
    held: list[int] = []  # the view's bytes after each step
    spy_launches(engine, lambda p: held.append(engine.runner._view.nbytes if engine.runner._view else 0))
    got = {im.sample.index: im.seqs[0].output.tokens for im in engine.run(Sample(0, i, f"k{i}", p)
                                                                     for i, p in enumerate(prepared[:n]))}
    assert [tuple(got[i]) for i in range(n)] == [want[i][0] for i in range(n)]
    assert engine.stats["rows"] == n and held[0] == 0  # the first step prefills all four images
    assert held[1] == max(held) == engine.stats["prefix_view_bytes"] > 0
    # A host with little memory left (a container's cgroup limit, read as memory.py reads it):
    # the cache gets what is left after the view's bytes, not all of it.
    # (the self and cross kinds share their tensors: CrossKV.shares)
    tensors = {id(t): t for kv in engine.runner.cache.paged.values() for t in (kv.k, kv.v)}
    per_block = sum(t.nbytes for t in tensors.values()) // engine.stats["kv_blocks"]
    free = held[1] + 12 * per_block
    (tmp_path / "memory.max").write_text(str(free))
    (tmp_path / "memory.current").write_text("0")
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    tight = settings.model_copy(update={"kv_memory_fraction": 0.98})
    sized = Engine(model, family.sequences(tasks_of(TASKS[:1]), tight), tight, family.max_prefix_len())
    assert sized.stats["kv_blocks"] == int((free - held[1]) * 0.98) // per_block < int(free * 0.98) // per_block
    # Too little beside four rows' copies for one image's cache: the rows halve, and the log says so.
    per_row = held[1] // n
    free = n * per_row + 5 * per_block
    (tmp_path / "memory.max").write_text(str(free))
    said: list[str] = []
    halved = Engine(model, family.sequences(tasks_of(TASKS[:1]), tight), tight, family.max_prefix_len(),
                    log=said.append)
    assert halved.stats["rows"] == 2 and halved.stats["prefix_view_bytes"] == 2 * per_row
    assert halved.stats["kv_blocks"] == int((free - 2 * per_row) * 0.98) // per_block
    assert said == ["batchvlm: the attention's prefix copies for every row leave no cpu memory for one image's KV "
                    "cache; trying 2 rows (engine.max_batch_size=4)"]


def test_channel_attention_as_two_matmuls_is_sdpa_bit_for_bit():
    """DaViT's channel attention (head_dim = cells) runs as two matmuls around a small softmax,
    scaled as torch's SDPA fallback scales: float32 values equal SDPA's exactly."""
    import torch.nn.functional as F

    from batchvlm.models.florence2.vision import ChannelAttention

    torch.manual_seed(0)
    for B, T, C, groups in [(3, 484, 16, 1), (2, 121, 24, 2), (1, 2304, 64, 2)]:
        m = ChannelAttention(C, groups, bias=True)
        x = torch.randn(B, T, C)
        with torch.inference_mode():
            q, k, v = m.qkv(x).view(B, T, 3, groups, C // groups).permute(2, 0, 3, 4, 1)
            out = F.scaled_dot_product_attention(q, k, v, scale=T**-0.5)
            assert torch.equal(m(x), m.proj(out.permute(0, 3, 1, 2).reshape(B, T, C)))
