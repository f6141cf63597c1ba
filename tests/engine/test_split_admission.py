"""Admission steps split (runner.py `_split`): the prefixes and prompts by one eager forward, the
decode rows by their graph (uncaptured on CPU: the same fixed-shape body), give the labels of the
one mixed forward, bit for bit, on every family, at batch sizes 1 / 7 / 64, pipelined or not."""

import pytest
import torch
from PIL import Image
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.moondream.config import MoondreamConfig


def moondream(tmp):
    folder = hub_folder(tmp / "md", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5), id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    g = torch.Generator().manual_seed(3)
    prepared = [md.preprocessor(Image.fromarray(torch.randint(0, 256, (40 + 37 * (i % 3), 60, 3), generator=g,
                                                              dtype=torch.uint8).numpy())) for i in range(5)]
    return md.engine, lambda settings: md.sequences(TASKS, max_new_tokens=settings.max_new_tokens, max_objects=2), \
        prepared, md.P


def qwen(tmp, fixture):
    pytest.importorskip("transformers")
    from support.inputs import encode_image
    from support.qwen_vl import TASKS as QWEN_TASKS
    from support.qwen_vl import images

    from batchvlm.data.decode import decode
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import ClassifyTask

    family = open_family(ModelSpec(name=str(fixture(tmp / "q", seed=2))))
    tasks = [*QWEN_TASKS[:3], ClassifyTask(classify={"question": "Which?", "choices": ["red", "red car", "blue"]})]
    pre = family.preprocessor()
    prepared = [pre(d.image, d.width, d.height) for d in (decode(encode_image(im, "PNG"), 10**8) for im in images()[:4])]
    return family.load("float32", "cpu"), lambda settings: family.sequences(tasks, settings), prepared, \
        family.max_prefix_len()


def qwen3_vl(tmp):
    from support.qwen3vl_fixture import write_checkpoint
    return qwen(tmp, write_checkpoint)


def qwen3_5(tmp):
    from support.qwen35_fixture import write_checkpoint
    return qwen(tmp, write_checkpoint)


def florence2(tmp):
    pytest.importorskip("transformers")
    from support.florence2 import TASKS as FLORENCE_TASKS
    from support.florence2 import random_images, tasks_of
    from support.tiny_vlms import florence2 as build

    from batchvlm.models.registry import open_family

    family = open_family(ModelSpec(name=str(build(tmp / "f2", seed=1, generation=dict(no_repeat_ngram_size=3)))))
    specs = [*FLORENCE_TASKS, {"classify": {"question": "Is it?", "choices": ["yes", "no"]}}]
    pre = family.preprocessor()
    return family.load("float32", "cpu"), lambda settings: family.sequences(tasks_of(specs), settings), \
        [pre(im) for im in random_images(4)], family.max_prefix_len()


def labels(model, seqs, prepared, max_prefix_len, settings, split):
    engine = Engine(model, seqs, settings, max_prefix_len)
    r = engine.runner
    r.graphs = r.decode_graphs(capture=False)  # the CUDA path's steps, graph bodies run eagerly
    r.split_admission = split
    out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared))}
    assert engine.scheduler.blocks.used == 0
    return [out[i] for i in range(len(prepared))], engine.stats


@pytest.mark.parametrize("family", [moondream, qwen3_vl, qwen3_5, florence2])
def test_split_admission_steps_label_as_the_mixed_step(tmp_path, family):
    model, sequences, prepared, max_prefix_len = family(tmp_path)
    for batch in (1, 7, 64):
        for pipelined in (False, True):
            settings = EngineSpec(max_new_tokens=5, max_batch_size=batch, pipelined=pipelined, max_images_in_flight=3)
            seqs = sequences(settings)
            mixed, mixed_stats = labels(model, seqs, prepared, max_prefix_len, settings, split=False)
            split, stats = labels(model, seqs, prepared, max_prefix_len, settings, split=True)
            assert split == mixed, (batch, pipelined)
            assert mixed_stats["split_steps"] == 0
            if batch > 1:  # a step admitting beside running rows was split
                assert stats["split_steps"] > 0, (batch, pipelined, stats)
