"""The transformers backend through the real CLI, on tiny random checkpoints of six architectures
saved in the hub layout: every row labelled, and every label equal to what transformers' own
batch-1 `generate` in float32 writes for that image (the backend batches, pads on the left and
cuts at the stop token; none of that may change a label)."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image
from test_pipeline import broken_shard
from tiny_vlms import BUILDERS

from batchvlm.models import grounding
from batchvlm.models.transformers_backend.processor import load_processor


def tf():
    """transformers, imported when a test runs, never at collection: importing it imports
    huggingface_hub, which reads HF_HUB_CACHE once, before other tests' monkeypatching."""
    return pytest.importorskip("transformers")

NEW_TOKENS = 8
# architecture -> tasks (detect where batchvlm knows the model's grounding format)
TASKS = {
    "qwen2_5_vl": [{"caption": {}}, {"detect": {"objects": ["cat", "dog"]}}, {"point": {"objects": ["cup"]}}],
    "qwen3_vl": [{"query": {"question": "What colour is it?"}}, {"detect": {"objects": ["cat"]}}],
    "paligemma": [{"caption": {"length": "long"}}, {"detect": {"objects": ["cat", "dog"]}}],
    "florence2": [{"caption": {"length": "short"}}, {"detect": {"objects": ["car"]}}],
    "idefics3": [{"caption": {}}, {"query": {"question": "How many?", "max_new_tokens": 5}}],
    "llava": [{"query": {"question": "Is it red?"}}],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tf()
    root = tmp_path_factory.mktemp("hub")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def images(folder: Path) -> dict[str, Image.Image]:
    """Three images of different sizes and aspect ratios: batches pad prompts of different lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, (w, h) in enumerate([(90, 60), (64, 128), (150, 100)]):
        g = torch.Generator().manual_seed(i)
        im = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
        im.save(folder / f"im{i}.png")
        out[f"im{i}.png"] = im
    return out


def run_cli(tmp_path: Path, model: Path, tasks: list, **sections) -> subprocess.CompletedProcess:
    job = {"name": "hf", "input": {"folder": "imgs"}, "model": {"name": str(model), "backend": "transformers"},
           "tasks": tasks, "engine": {"max_new_tokens": NEW_TOKENS, "max_batch_size": 2},
           "loader": {"workers": 0}, "output": {"dir": "out", "raw_text": True}}
    for k, v in sections.items():
        job[k] = {**job.get(k, {}), **v}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True, timeout=300)


def reference(folder: Path, arch: str, ims: dict[str, Image.Image], words: list[tuple[str, int]]):
    """transformers' own batch-1 generate in float32, through transformers' own prompt path: the
    chat template with the image in the message (apply_chat_template tokenizes and processes), or
    the processor on the task words for PaliGemma / Florence-2.
    -> {key: [(new tokens before the stop, (width, height) the model saw or None) per sequence]}"""
    processor = load_processor(tf(), arch, folder)
    model = tf().AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    out = {}
    for key, image in ims.items():
        out[key] = []
        for text, budget in words:
            if arch in ("paligemma", "florence2"):
                enc = processor(images=image, text=text, return_tensors="pt")
            else:
                turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
                enc = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                    return_tensors="pt")
            enc.pop("labels", None)
            ids = model.generate(**enc, do_sample=False, max_new_tokens=budget)[0].tolist()
            ids = ids[1:] if model.config.is_encoder_decoder else ids[enc["input_ids"].shape[1]:]
            grid = enc.get("image_grid_thw")
            seen = (int(grid[0, 2]) * processor.image_processor.patch_size,
                    int(grid[0, 1]) * processor.image_processor.patch_size) if grid is not None else None
            out[key].append((ids[: ids.index(eos)] if eos in ids else ids, seen))
    return processor.tokenizer, out


def parsed(arch: str, kind: str, text: str, seen) -> list[tuple[float, ...]]:
    if arch == "qwen2_5_vl":
        return (grounding.qwen25_boxes if kind == "detect" else grounding.qwen25_points)(text, *seen)
    if arch == "qwen3_vl":
        return (grounding.qwen3_boxes if kind == "detect" else grounding.qwen3_points)(text)
    return {"paligemma": grounding.paligemma_boxes, "florence2": grounding.florence2_boxes}[arch](text)


WORDS = {  # what each task above says to each architecture (prompts.py), for the reference
    "qwen2_5_vl": [("Describe this image.", NEW_TOKENS),
                   ("Locate every cat in the image and output the bbox coordinates in JSON format.", NEW_TOKENS),
                   ("Locate every dog in the image and output the bbox coordinates in JSON format.", NEW_TOKENS),
                   ("Locate every cup in the image and output the point coordinates in JSON format.", NEW_TOKENS)],
    "qwen3_vl": [("What colour is it?", NEW_TOKENS),
                 ("Locate every cat in the image and output the bbox coordinates in JSON format.", NEW_TOKENS)],
    "paligemma": [("describe en", NEW_TOKENS), ("detect cat", NEW_TOKENS), ("detect dog", NEW_TOKENS)],
    "florence2": [("<CAPTION>", NEW_TOKENS), ("<OPEN_VOCABULARY_DETECTION>car", NEW_TOKENS)],
    "idefics3": [("Describe this image.", NEW_TOKENS), ("How many?", 5)],
    "llava": [("Is it red?", NEW_TOKENS)],
}


@pytest.mark.parametrize("arch", list(TASKS))
def test_labels_equal_transformers_batch_1_generate(tmp_path, checkpoints, arch):
    ims = images(tmp_path / "imgs")
    r = run_cli(tmp_path, checkpoints[arch], TASKS[arch])
    assert r.returncode == 0, r.stderr
    assert f"({arch}, transformers, float32, cpu)" in r.stderr
    table = pq.read_table(tmp_path / "out")  # the output folder itself is the dataset
    meta = json.loads(table.schema.metadata[b"batchvlm"])
    assert meta["model"]["backend"] == "transformers" and meta["model"]["family"] == arch
    rows = {row["key"]: row for row in table.to_pylist()}
    assert sorted(rows) == sorted(ims) and all(row["status"] == "ok" for row in rows.values())
    tok, want = reference(checkpoints[arch], arch, ims, WORDS[arch])
    for key in ims:
        row, seqs = rows[key], iter(want[key])
        for task in TASKS[arch]:
            kind, args = next(iter(task.items()))
            col = args.get("name", kind)
            if kind in ("caption", "query"):
                assert row[col] == tok.decode(next(seqs)[0], skip_special_tokens=True).strip(), (key, col)
                continue
            texts, objects = [], []
            for obj in args["objects"]:
                ids, seen = next(seqs)
                texts.append({"label": obj, "text": tok.decode(ids, skip_special_tokens=False)})
                keys = ("x_min", "y_min", "x_max", "y_max") if kind == "detect" else ("x", "y")
                objects += [{"label": obj} | dict(zip(keys, o)) for o in parsed(arch, kind, texts[-1]["text"], seen)]
            assert row[f"{col}_raw"] == texts, (key, col)
            assert row[col] == [o | {k: pytest.approx(v) for k, v in o.items() if k != "label"} for o in objects]
    if arch == "paligemma":  # random weights write <locNNNN> tokens: the boxes above were not all empty
        assert any(row["detect"] for row in rows.values())


def test_error_rows_and_resume(tmp_path, checkpoints):
    """Bad images are rows as on the native path; a second run skips the finished shard."""
    expected = broken_shard(tmp_path / "mixed-000.tar")
    job = {"name": "hf", "input": {"shards": "mixed-000.tar"},
           "model": {"name": str(checkpoints["qwen2_5_vl"]), "backend": "transformers"},
           "tasks": [{"caption": {}}], "engine": {"max_new_tokens": 4, "max_batch_size": 4},
           "loader": {"workers": 2}, "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "batchvlm.cli", "run", str(tmp_path / "job.yaml")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "1 shard(s) written" in r.stderr and "5 errors" in r.stderr, r.stderr
    rows = pq.read_table(tmp_path / "out" / "mixed-000.parquet").to_pylist()
    assert [row["key"] for row in rows] == list(expected)
    for row in rows:
        status, w, h, err = expected[row["key"]]
        assert (row["status"], row["width"], row["height"]) == (status, w, h), row
        assert (err in row["error"] and row["caption"] is None) if err else isinstance(row["caption"], str)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "0 shard(s) written, 1 already done" in r.stderr, r.stderr


def test_unsupported_grounding_and_unloadable_models_are_one_line(tmp_path, checkpoints):
    images(tmp_path / "imgs")
    r = run_cli(tmp_path, checkpoints["llava"], [{"detect": {"objects": ["cat"]}}])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("batchvlm: error: tasks.0.detect: model_type 'llava'")
    assert "qwen2.5-vl" in last and "paligemma" in last and "florence-2" in last
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.family import FamilyError
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import PointTask

    with pytest.raises(FamilyError, match=r"tasks.0.point: model_type 'paligemma' .*\(its format, paligemma, has no points\)"):
        open_family(ModelSpec(name=str(checkpoints["paligemma"]))).sequences(
            [PointTask(point={"objects": ["cat"]})], EngineSpec())
    text_only = tmp_path / "bert"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run_cli(tmp_path, text_only, [{"caption": {}}])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "batchvlm: error: model.name: model_type 'bert' is not an image-text-to-text model that transformers "
        f"{tf().__version__} can load (AutoModelForImageTextToText)"]


def test_backend_choice_and_missing_package(tmp_path, checkpoints, monkeypatch):
    """auto = native where a family matches config.json, else transformers; native insists; a
    missing transformers package names the extra to install."""
    from batchvlm.job import ModelSpec
    from batchvlm.models.family import ModelLoadError
    from batchvlm.models.registry import open_family

    assert (open_family(ModelSpec(name="demo")).backend, open_family(ModelSpec(name="demo")).name) == ("native",
                                                                                                        "moondream")
    family = open_family(ModelSpec(name=str(checkpoints["idefics3"])))
    assert (family.backend, family.name) == ("transformers", "idefics3")
    with pytest.raises(ModelLoadError, match="model.backend: native, but batchvlm has no native family for model_type "
                                             "'idefics3'"):
        open_family(ModelSpec(name=str(checkpoints["idefics3"]), backend="native"))
    with pytest.raises(ModelLoadError, match="model_type 'moondream1' is unknown to transformers"):
        open_family(ModelSpec(name="demo", backend="transformers"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'batchvlm\[transformers\]'"):
        open_family(ModelSpec(name=str(checkpoints["idefics3"])))


def test_sampling_follows_the_job_seed(checkpoints):
    """temperature > 0 samples (labels differ from greedy) and the same seed gives the same labels."""
    from batchvlm.engine.labeler import WorkItem
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import CaptionTask

    family = open_family(ModelSpec(name=str(checkpoints["qwen3_vl"]), backend="transformers"))
    model = family.load("float32", "cpu")
    ims = images(Path(checkpoints["qwen3_vl"]).parent / "sampling-imgs")
    items = [WorkItem(k, family.preprocessor()(im), k) for k, im in ims.items()]

    def captions(**engine) -> dict[str, str]:
        spec = EngineSpec(max_new_tokens=NEW_TOKENS, **engine)
        seqs = family.sequences([CaptionTask()], spec)
        return {k: family.columns([CaptionTask()], seqs, raws)["caption"] for k, raws in model.labeler(seqs, spec).label(items)}

    greedy = captions()
    sampled = captions(temperature=1.0, seed=3)
    assert sampled == captions(temperature=1.0, seed=3) and sampled != greedy

