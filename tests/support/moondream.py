"""A tiny Moondream for tests: its config, hub-like folders with id tokenizers and random weights,
the family loaded with the shorthands the tests use, the engine run to the end, and the tasks of
the upstream reference fixtures (shared/fixtures/moondream-tiny)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.models.base.decoding import RawOutput
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.host import Moondream
from batchvlm.models.moondream.device import MoondreamEngineModel
from batchvlm.models.moondream.generate import generate
from batchvlm.models.moondream.model import MoondreamModel
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

TINY = {
    "text": {"dim": 32, "ff_dim": 64, "n_layers": 2, "vocab_size": 64, "n_heads": 2, "n_kv_heads": 2, "max_context": 512},
    "vision": {"enc_dim": 16, "enc_patch_size": 14, "enc_n_layers": 1, "enc_ff_dim": 32, "enc_n_heads": 2,
               "proj_out_dim": 32, "crop_size": 56, "max_crops": 4, "overlap_margin": 1, "proj_inner_dim": 32},
    "region": {"dim": 32, "coord_feat_dim": 16, "coord_out_dim": 64, "size_feat_dim": 16, "size_out_dim": 64,
               "inner_dim": 32},
    "tokenizer": {"templates": {"caption": {"short": [1, 2, 3], "normal": [1, 2, 3], "long": [1, 2, 3]},
                                "query": {"prefix": [1, 8], "suffix": [3]}, "detect": {"prefix": [1, 9], "suffix": [3]},
                                "point": {"prefix": [1, 10], "suffix": [3]}}},
}


class LoadedMoondream:
    """Host family + loaded engine model, with the shorthands the tests use."""

    def __init__(self, name: str, revision: str | None = None, device: str = "cpu", dtype: str = "auto"):
        from batchvlm.job import ModelSpec
        from batchvlm.models.registry import open_family

        self.family: Moondream = open_family(ModelSpec(name=name, revision=revision))
        self.engine: MoondreamEngineModel = self.family.load(dtype, device)
        self.model: MoondreamModel = self.engine.model
        self.config = self.family.config
        self.preprocessor = self.family.preprocessor()
        self.P = self.family.max_prefix_len()
        self.info = self.engine.info

    def sequences(self, tasks, max_new_tokens: int = 128, max_objects: int = 50, temperature: float = 0.0,
                  top_p: float = 1.0):
        return self.family.sequences(tasks, EngineSpec(max_new_tokens=max_new_tokens, max_objects=max_objects,
                                                       temperature=temperature, top_p=top_p))

    def label(self, images, tasks, max_new_tokens: int = 128, max_objects: int = 50) -> list[dict]:
        """The simple static-batch generation, as labelled columns."""
        prepared = [self.preprocessor(im) for im in images]
        seqs = self.sequences(tasks, max_new_tokens, max_objects)
        raws = generate(self.model, prepared, [s.spec for s in seqs])
        return [self.family.columns(tasks, seqs, r) for r in raws]


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """encode("12 7") -> [12, 7]: the stand-in the parity fixtures were made with."""
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def hub_folder(dest: Path, config: dict, weights: Path | dict, tokenizer: Tokenizer | None) -> Path:
    """A folder laid out like the hub repo: wrapper config.json, model.safetensors, tokenizer.json."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": config}))
    if isinstance(weights, Path):
        shutil.copyfile(weights, dest / "model.safetensors")
    else:
        save_file(weights, str(dest / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save(str(dest / "tokenizer.json"))
    return dest


def random_state(config: MoondreamConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with non-trivial attention (the fixtures' recipe, roughly)."""
    g = torch.Generator().manual_seed(seed)
    model = MoondreamModel(config)
    out = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=g)
        if name.endswith(("ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            t = 1 + 0.05 * t
        elif name.endswith(".bias"):
            t = 0.02 * t
        elif name.endswith("qkv.weight"):
            t = 2 * t / p.shape[1] ** 0.5
        elif name.endswith(".weight"):
            t = t / p.shape[1] ** 0.5
        out[f"model.{name}"] = t.contiguous()
    return out


TASKS = [CaptionTask(caption={"length": "short"}), QueryTask(query={"question": "11 12"}),
         DetectTask(detect={"objects": ["20", "21 22"]}), PointTask(point={"objects": ["23"]})]


def run_engine_outputs(md, prepared, seqs, fixed_shape_decode=False, **settings) -> list[list[RawOutput]]:
    engine = Engine(md.engine, seqs, EngineSpec(**settings), md.P)
    if fixed_shape_decode:  # the CUDA-graph decode body (padding, scratch row, null block), uncaptured
        r = engine.runner
        r.graphs = r.decode_graphs(capture=False)
    out = {im.sample.index: [s.output for s in im.seqs]
           for im in engine.run(Sample(0, i, f"key{i}", p) for i, p in enumerate(prepared))}
    assert engine.scheduler.blocks.used == 0  # every block came back
    return [out[i] for i in range(len(prepared))]


def run_engine(md, prepared, seqs, fixed_shape_decode=False, **settings):
    """-> (tokens, objects) of every sequence of every image."""
    return [[(o.tokens, o.objects) for o in img]
            for img in run_engine_outputs(md, prepared, seqs, fixed_shape_decode, **settings)]


def upstream_tasks(expected):
    """The four tasks the upstream reference ran (shared/fixtures/moondream-tiny expected.json)."""
    question = " ".join(map(str, expected["question_ids"]))
    obj = " ".join(map(str, expected["object_ids"]))
    return [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": question}),
            DetectTask(detect={"objects": [obj]}), PointTask(point={"objects": [obj]})]


def wanted_more(e: dict, kind: str, n: int, eos: int) -> bool:
    """The reference's decision after its n-th object (decisions[0] is the prompt's): another
    object, not EOS. A run with max_objects = n is truncated exactly then."""
    decisions = e[kind]["decisions"]
    return len(decisions) > n and decisions[n]["token"] != eos
