"""The transformers backend through the CLI, on tiny random checkpoints of eleven architectures
saved in the hub layout: every row labelled, and every label equal to what transformers' own
batch-1 `generate` in float32 writes for that image, with the prompts docs/models/transformers.md documents and
chat templates in their non-thinking form (the backend batches, pads on the left and cuts at the
stop token; none of that may change a label). Where batchvlm has a native family (Qwen3-VL),
both backends give identical labels. Runs go through the CLI app in this process (transformers is
imported once), but for the one whose process is the point: loader workers."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image
from support.cli import inproc
from support.inputs import broken_shard
from support.tiny_vlms import BUILDERS, mistral3

from batchvlm.models.base import grounding
from batchvlm.models.transformers_backend.processor import load_processor


def tf():
    """transformers, imported when a test runs, never at collection: importing it imports
    huggingface_hub, which reads HF_HUB_CACHE once, before other tests' monkeypatching."""
    return pytest.importorskip("transformers")

NEW_TOKENS = 8
ALL_FOUR = [{"caption": {}}, {"query": {"question": "What colour is it?"}}, {"detect": {"objects": ["cat"]}},
            {"point": {"objects": ["cup"]}}]
# architecture -> tasks (detect where batchvlm knows the model's grounding format)
TASKS = {
    "qwen2_5_vl": [{"caption": {}}, {"detect": {"objects": ["cat", "dog"]}}, {"point": {"objects": ["cup"]}}],
    "qwen3_vl": ALL_FOUR,
    "qwen3_vl_moe": ALL_FOUR,
    "qwen3_5": ALL_FOUR,
    "paligemma": [{"caption": {"length": "long"}}, {"detect": {"objects": ["cat", "dog"]}}],
    "florence2": [{"caption": {"length": "short"}}, {"detect": {"objects": ["car"]}}],
    "idefics3": [{"caption": {}}, {"query": {"question": "How many?", "max_new_tokens": 5}}],
    "smolvlm": [{"caption": {"length": "long"}}, {"query": {"question": "Is it red?"}}],
    "llava": [{"query": {"question": "Is it red?"}}],
    "gemma4": [{"caption": {}}, {"query": {"question": "Is it red?"}}],
}
# (images, engine.max_batch_size, engine.max_new_tokens): 8 images in batches of 7 label a batch of
# 7 and a batch of 1 in one run; the others 3 images in batches of 2 (a batch of 2 and one of 1)
BATCHES = {"qwen3_5": (8, 7, 4)}
THINKING = {"qwen3_5"}  # templates with the enable_thinking switch: the reference turns it off


class Checkpoints:
    """Each architecture's tiny checkpoint, built the first time a test asks for it."""

    def __init__(self, root: Path):
        self.root, self.built = root, {}

    def __getitem__(self, arch: str) -> Path:
        if arch not in self.built:
            self.built[arch] = BUILDERS[arch](self.root / arch)
        return self.built[arch]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    tf()
    return Checkpoints(tmp_path_factory.mktemp("hub"))


SIZES = [(90, 60), (64, 128), (150, 100), (40, 40), (120, 48), (70, 90), (33, 77), (100, 100)]


def images(folder: Path, n: int = 3) -> dict[str, Image.Image]:
    """Images of different sizes and aspect ratios: batches pad prompts of different lengths."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, (w, h) in enumerate(SIZES[:n]):
        g = torch.Generator().manual_seed(i)
        im = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
        im.save(folder / f"im{i}.png")
        out[f"im{i}.png"] = im
    return out


def run_cli(tmp_path: Path, checkpoint: Path, tasks: list, out: str = "out", **sections) -> subprocess.CompletedProcess:
    """`batchvlm run` of a job on tmp_path/imgs, through the CLI app in this process."""
    job = {"name": "hf", "input": {"folder": "imgs"}, "model": {"name": str(checkpoint), "backend": "transformers"},
           "tasks": tasks, "engine": {"max_new_tokens": NEW_TOKENS, "max_batch_size": 2},
           "loader": {"workers": 0}, "output": {"dir": out, "raw_text": True}}
    for k, v in sections.items():
        job[k] = {**job.get(k, {}), **v}
    (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(job))
    code, output = inproc(tmp_path, "run", tmp_path / f"{out}.yaml")
    return subprocess.CompletedProcess([], code, output, output)


@pytest.fixture(scope="module")
def labelled(checkpoints, tmp_path_factory):
    """(arch, backend) -> (CLI result, images, rows by key, Parquet metadata); each run once."""
    runs, folders = {}, {}

    def get(arch: str, backend: str = "transformers"):
        if (arch, backend) not in runs:
            if arch not in folders:
                folders[arch] = tmp_path_factory.mktemp(arch)
            n, batch, new_tokens = BATCHES.get(arch, (3, 2, NEW_TOKENS))
            ims = images(folders[arch] / "imgs", n)
            r = run_cli(folders[arch], checkpoints[arch], TASKS[arch], out=f"out-{backend}",
                        model={"backend": backend}, engine={"max_batch_size": batch, "max_new_tokens": new_tokens})
            assert r.returncode == 0, r.stderr
            table = pq.read_table(folders[arch] / f"out-{backend}")  # the output folder itself is the dataset
            rows = {row["key"]: row for row in table.to_pylist()}
            runs[arch, backend] = (r, ims, rows, json.loads(table.schema.metadata[b"batchvlm"]))
        return runs[arch, backend]

    return get


def reference(folder: Path, arch: str, ims: dict[str, Image.Image], words: list[tuple[str, int | None]]):
    """transformers' own batch-1 generate in float32, through transformers' own prompt path: the
    chat template with the image in the message (apply_chat_template tokenizes and processes), or
    the processor on the task words for PaliGemma / Florence-2.
    -> {key: [(new tokens before the stop, (width, height) the model saw or None, cut short) per
    sequence]}. Cut short: no stop token in the budget; where the generation config forces EOS as
    the last token (Florence-2), judged by a second generate without forcing."""
    processor = load_processor(tf(), arch, folder)
    model = tf().AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    forced = model.generation_config.forced_eos_token_id is not None
    switch = {"enable_thinking": False} if arch in THINKING else {}
    out = {}
    for key, image in ims.items():
        out[key] = []
        for text, budget in words:
            budget = budget or BATCHES.get(arch, (0, 0, NEW_TOKENS))[2]
            if arch in ("paligemma", "florence2"):
                enc = processor(images=image, text=text, return_tensors="pt")
            else:
                turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
                enc = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                    return_tensors="pt", **switch)
            enc.pop("labels", None)
            start = 1 if model.config.is_encoder_decoder else enc["input_ids"].shape[1]
            ids = model.generate(**enc, do_sample=False, max_new_tokens=budget)[0].tolist()[start:]
            free = model.generate(**enc, do_sample=False, max_new_tokens=budget, forced_eos_token_id=None)[0].tolist()[
                start:] if forced else ids
            grid = enc.get("image_grid_thw")
            seen = (int(grid[0, 2]) * processor.image_processor.patch_size,
                    int(grid[0, 1]) * processor.image_processor.patch_size) if grid is not None else None
            out[key].append((ids[: ids.index(eos)] if eos in ids else ids, seen, eos not in free))
    return processor.tokenizer, out


def parsed(arch: str, kind: str, text: str, seen) -> list[tuple[float, ...]]:
    if arch == "qwen2_5_vl":
        return (grounding.qwen25_boxes if kind == "detect" else grounding.qwen25_points)(text, *seen)
    if arch.startswith("qwen3"):
        return (grounding.qwen3_boxes if kind == "detect" else grounding.qwen3_points)(text)
    return {"paligemma": grounding.paligemma_boxes, "florence2": grounding.florence2_boxes}[arch](text)


QWEN3_WORDS = [  # the Qwen3-VL / Qwen3.5 prompts of docs/models/qwen3-vl.md
    ("Describe this image.", None), ("What colour is it?", None),
    ('Locate every instance that belongs to the following categories: "cat". Report bbox coordinates in JSON format.',
     None),
    ("Locate every cup in this image with points. Output the point coordinates in JSON format.", None)]
WORDS = {  # what each task above says to each architecture (docs/models/transformers.md: "Prompts"), for the reference;
    # (words, the sequence's max_new_tokens or None: the run's)
    "qwen2_5_vl": [("Describe this image.", NEW_TOKENS),
                   ("Locate every cat in the image and output the bbox coordinates in JSON format.", NEW_TOKENS),
                   ("Locate every dog in the image and output the bbox coordinates in JSON format.", NEW_TOKENS),
                   ("Locate every cup in the image and output the point coordinates in JSON format.", NEW_TOKENS)],
    "qwen3_vl": QWEN3_WORDS, "qwen3_vl_moe": QWEN3_WORDS, "qwen3_5": QWEN3_WORDS,
    "paligemma": [("describe en", NEW_TOKENS), ("detect cat", NEW_TOKENS), ("detect dog", NEW_TOKENS)],
    "florence2": [("<CAPTION>", NEW_TOKENS), ("<OPEN_VOCABULARY_DETECTION>car", NEW_TOKENS)],
    "idefics3": [("Describe this image.", NEW_TOKENS), ("How many?", 5)],
    "smolvlm": [("Describe this image in detail.", NEW_TOKENS), ("Is it red?", NEW_TOKENS)],
    "llava": [("Is it red?", NEW_TOKENS)],
    "gemma4": [("Describe this image.", NEW_TOKENS), ("Is it red?", NEW_TOKENS)],
}


@pytest.mark.parametrize("arch", list(TASKS))
def test_labels_equal_transformers_batch_1_generate(checkpoints, labelled, arch):
    r, ims, rows, meta = labelled(arch)
    assert f"({arch}, transformers, float32, cpu)" in r.stderr
    assert meta["model"]["backend"] == "transformers" and meta["model"]["family"] == arch
    assert sorted(rows) == sorted(ims) and all(row["status"] == "ok" for row in rows.values())
    tok, want = reference(checkpoints[arch], arch, ims, WORDS[arch])
    # The raw-text rule: Qwen's JSON is text, read without special tokens and stripped; the
    # location tokens of PaliGemma / Florence-2 may be special tokens, so their text keeps them.
    qwen = arch.startswith("qwen")
    for key in ims:
        row, seqs = rows[key], iter(want[key])
        for task in TASKS[arch]:
            kind, args = next(iter(task.items()))
            col = args.get("name", kind)
            if kind in ("caption", "query"):
                ids, _, cut = next(seqs)
                assert row[col] == tok.decode(ids, skip_special_tokens=True).strip(), (key, col)
                assert row[f"{col}_truncated"] == cut, (key, col)
                continue
            texts, objects, cuts = [], [], []
            for obj in args["objects"]:
                ids, seen, cut = next(seqs)
                text = tok.decode(ids, skip_special_tokens=qwen)
                texts.append({"label": obj, "text": text.strip() if qwen else text})
                cuts.append(cut)
                keys = ("x_min", "y_min", "x_max", "y_max") if kind == "detect" else ("x", "y")
                objects += [{"label": obj} | dict(zip(keys, o)) for o in parsed(arch, kind, texts[-1]["text"], seen)]
            assert row[f"{col}_raw"] == texts, (key, col)
            assert row[col] == [o | {k: pytest.approx(v) for k, v in o.items() if k != "label"} for o in objects]
            assert row[f"{col}_truncated"] == any(cuts), (key, col)
    if arch == "paligemma":  # random weights write <locNNNN> tokens: the boxes above were not all empty
        assert any(row["detect"] for row in rows.values())
    if arch == "florence2":  # forced EOS at the budget is a cut: some captions ran into it
        assert any(row["caption_truncated"] for row in rows.values())


def test_native_and_transformers_backends_give_identical_labels(labelled):
    """One Qwen3-VL checkpoint, all four tasks: the native family and the transformers backend send
    the same prompts and read the same text (one prompt table, one raw-text rule)."""
    r, ims, native, meta = labelled("qwen3_vl", "native")
    assert "(qwen3_vl, native, float32, cpu)" in r.stderr and meta["model"]["backend"] == "native"
    _, _, transformers_rows, _ = labelled("qwen3_vl")
    assert sorted(native) == sorted(ims)
    for key, row in native.items():
        assert row == transformers_rows[key], key


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
    code, output = inproc(tmp_path, "run", tmp_path / "job.yaml")
    assert code == 0 and "0 shard(s) written, 1 already done" in output, output


def test_unsupported_grounding_and_unloadable_models_are_one_line(tmp_path, checkpoints):
    """Refused before anything is written: `run` checks what `validate` checks, no output folder."""
    images(tmp_path / "imgs")
    r = run_cli(tmp_path, checkpoints["llava"], [{"detect": {"objects": ["cat"]}}])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("batchvlm: error: tasks.0.detect: model_type 'llava'")
    assert "qwen2.5-vl" in last and "paligemma" in last and "florence-2" in last
    assert not (tmp_path / "out").exists()
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.base.errors import FamilyError
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
    assert not (tmp_path / "out").exists()


def test_a_processor_that_needs_torchvision_is_one_line_at_validate(tmp_path):
    """Mistral3's processor (PixtralProcessor) needs torchvision: where it does not import, the
    check validate and run make (check_tasks; the CLI prints the message as one error line) names
    the model type and what is missing in one line."""
    if not getattr(type(tf().PixtralProcessor), "is_dummy", False):
        pytest.skip("torchvision imports here: PixtralProcessor is the real class")
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.base.errors import ModelLoadError
    from batchvlm.models.registry import check_tasks
    from batchvlm.tasks import CaptionTask

    model = mistral3(tmp_path / "mistral3")
    with pytest.raises(ModelLoadError) as e:
        check_tasks(ModelSpec(name=str(model)), [CaptionTask()], EngineSpec())
    assert str(e.value) == (f"model.name: model_type 'mistral3': cannot build its processor from {model}: transformers "
                            f"{tf().__version__}'s PixtralProcessor needs torchvision, which cannot be imported here")


def test_backend_choice_and_missing_package(tmp_path, checkpoints, monkeypatch):
    """auto = native where a family matches config.json, else transformers; native insists; a
    missing transformers package names the extra to install."""
    from batchvlm.job import ModelSpec
    from batchvlm.models.base.errors import ModelLoadError
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
    from batchvlm.data.loader import Sample
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import CaptionTask

    family = open_family(ModelSpec(name=str(checkpoints["qwen3_vl"]), backend="transformers"))
    model = family.load("float32", "cpu")
    ims = images(Path(checkpoints["qwen3_vl"]).parent / "sampling-imgs")
    samples = [Sample(0, i, k, family.preprocessor()(im)) for i, (k, im) in enumerate(ims.items())]

    def captions(**engine) -> dict[str, str]:
        spec = EngineSpec(max_new_tokens=NEW_TOKENS, **engine)
        seqs = family.sequences([CaptionTask()], spec)
        return {s.key: family.columns([CaptionTask()], seqs, raws)["caption"]
                for s, raws in model.labeler(seqs, spec).label(samples)}

    greedy = captions()
    sampled = captions(temperature=1.0, seed=3)
    assert sampled == captions(temperature=1.0, seed=3) and sampled != greedy




def test_an_end_the_model_chose_at_the_forced_position_is_not_a_cut(checkpoints, tmp_path):
    """Florence-2's generation config forces </s> as the last allowed token. Where transformers'
    unforced generate stops at exactly that position, the model ended by itself (not truncated);
    with one token less allowed, the forced end cut it. The random model never writes </s>, so a
    copy of it also stops at a token its caption writes (a second eos_token_id)."""
    import shutil

    from batchvlm.data.loader import Sample
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import CaptionTask

    folder = shutil.copytree(checkpoints["florence2"], tmp_path / "florence2")
    im = next(iter(images(tmp_path / "imgs", 1).values()))
    processor = load_processor(tf(), "florence2", folder)
    hf = tf().AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    assert hf.generation_config.forced_eos_token_id == eos
    enc = processor(images=im, text="<CAPTION>", return_tensors="pt")
    free = hf.generate(**enc, do_sample=False, max_new_tokens=12, forced_eos_token_id=None)[0].tolist()[1:]
    n = next(k for k in range(1, len(free)) if free[k] not in free[:k]) + 1  # stop there: n tokens with it
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [eos, free[n - 1]]}))
    hf.generation_config.eos_token_id = [eos, free[n - 1]]
    assert hf.generate(**enc, do_sample=False, max_new_tokens=n, forced_eos_token_id=None)[0].tolist()[1:] == free[:n]

    family = open_family(ModelSpec(name=str(folder), backend="transformers"))
    model, prepared = family.load("float32", "cpu"), family.preprocessor()(im)
    for limit, cut in ((n, False), (n - 1, True)):
        engine = EngineSpec(max_new_tokens=limit, max_batch_size=1)
        (_, (raw,)), = model.labeler(family.sequences([CaptionTask(caption={"length": "short"})], engine),
                                     engine).label([Sample(0, 0, "k", prepared)])
        assert (raw.cut, raw.tokens) == (cut, free[: limit - 1]), limit
