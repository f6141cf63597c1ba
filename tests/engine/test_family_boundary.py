"""The engine knows no model family: a deliberately different toy family (variable-length
causal prefixes, 2-D positions that are not slot indices, GQA, text output) runs through the
real engine and equals its own dense one-at-a-time reference."""

import re
from pathlib import Path

import pytest
import torch
from support.toy_family import PIXELS, ToyImage, ToyModel, reference
from support.paths import REPO

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.models.base.decoding import MODE_TEXT, SeqSpec
from batchvlm.models.base.contract import TaskSequence

ROOT = REPO / "batchvlm"


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(7)
    lengths = [3, 300, 17, 64, 5, 129, 250, 33, 8, 77, 190, 41, 12, 299, 96]
    images = [ToyImage(torch.randn(n, PIXELS, generator=g)) for n in lengths]
    specs = [SeqSpec(MODE_TEXT, (5, 6, 7), 9), SeqSpec(MODE_TEXT, (8,), 4), SeqSpec(MODE_TEXT, tuple(range(10, 30)), 12)]
    model = ToyModel(seed=3)
    want = [[reference(model, im, sp) for sp in specs] for im in images]
    stopped = [len(w) < sp.limit for img in want for w, sp in zip(img, specs)]
    assert any(stopped) and not all(stopped)  # some sequences stop by themselves, some hit the limit
    return model, images, [TaskSequence(i, None, sp) for i, sp in enumerate(specs)], want


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("pipelined", [False, True])
def test_toy_family_equals_its_dense_reference(toy, batch, pipelined):
    model, images, seqs, want = toy
    engine = Engine(model, seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined, max_images_in_flight=5,
                                            block_size=16), max_prefix_len=300)
    got = {im.sample.index: [s.output.tokens for s in im.seqs]
           for im in engine.run(Sample(0, i, str(i), p) for i, p in enumerate(images))}
    assert [got[i] for i in range(len(images))] == want
    assert engine.scheduler.blocks.used == 0  # every block came back


def test_nothing_outside_models_imports_a_family():
    """engine/, run/, tasks.py, data/ and output/ reach models only through the interface (the
    family boundary, decoding, the attention backends, the registry)."""
    paths = [ROOT / "tasks.py"] + [p for d in ("run", "engine", "data", "output") for p in (ROOT / d).rglob("*.py")]
    family_import = re.compile(r"^\s*(from|import)\s+\S*models\.(?!base\.(contract|decoding|errors)\b|registry\b)\w+",
                               re.M)
    offenders = [str(p.relative_to(ROOT)) for p in paths if family_import.search(p.read_text())]
    assert offenders == []
    assert all("moondream" not in line for p in paths for line in p.read_text().splitlines()
               if not line.lstrip().startswith("#"))


def test_models_import_nothing_from_the_engine():
    """The layers: engine/ drives models/ through the interface; models/ (and the neutral
    cache/ both share) never import engine/, not even for type checking."""
    engine_import = re.compile(r"^\s*(from|import)\s+(\.\.+|batchvlm\.)engine\b", re.M)
    paths = [p for d in ("models", "cache") for p in (ROOT / d).rglob("*.py")]
    assert [str(p.relative_to(ROOT)) for p in paths if engine_import.search(p.read_text())] == []
    models_import = re.compile(r"^\s*(from|import)\s+(\.\.+|batchvlm\.)(models|engine)\b", re.M)
    assert [str(p.relative_to(ROOT)) for p in (ROOT / "cache").rglob("*.py") if models_import.search(p.read_text())] == []


def test_data_and_output_import_one_way():
    """output/ (the output folder: layout, manifest, shard list, writer) reads inputs through data/;
    data/ (sources, decoding, loader) knows nothing of the output folder: no package cycle."""
    import ast

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found.add("." * node.level + (node.module or ""))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        return found

    def offenders(package: str, other: str) -> list[str]:
        return [f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / package).rglob("*.py") for m in imports(p)
                if m.startswith(f"..{other}") or m.startswith(f"batchvlm.{other}")]

    assert offenders("data", "output") == []
    assert offenders("output", "data") != []  # the one allowed direction is in use
