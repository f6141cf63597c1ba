"""SigLIP through the CLI: a folder of PNGs with text sidecars -> `batchvlm run` -> Parquet whose
embed / classify / similarity columns have their Arrow types and transformers' values (within
1e-5); and the one-line refusals of `validate`."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

from support.cli import cli, cli_app
from support.siglip_fixture import random_images, siglip2_checkpoint

tf = pytest.importorskip("transformers")
CHOICES = ["cat", "dog", "car"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return siglip2_checkpoint(tmp_path_factory.mktemp("siglip2"))


def job_file(tmp_path, model, tasks, keep=("txt",)) -> str:
    job = {"name": "siglip", "input": {"folder": "imgs", "keep": list(keep)}, "model": {"name": str(model)},
           "tasks": tasks, "loader": {"workers": 1}, "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return str(tmp_path / "job.yaml")


def test_run_writes_typed_columns_with_transformers_values(checkpoint, tmp_path):
    images = random_images(9, seed=5)
    texts = [f"A photo of thing {i}" for i in range(9)]
    (tmp_path / "imgs").mkdir()
    for i, (im, text) in enumerate(zip(images, texts)):
        im.save(tmp_path / "imgs" / f"{i:02d}.png")
        if i != 4:  # one image has no text: its similarity is null
            (tmp_path / "imgs" / f"{i:02d}.txt").write_text(text)
    tasks = [{"embed": {}}, {"embed": {"name": "e16", "dtype": "float16"}}, {"classify": {"choices": CHOICES}},
             {"classify": {"choices": CHOICES, "template": "a {} in the picture", "name": "own"}},
             {"similarity": {"text_column": "txt", "name": "clip_score"}}]
    cli("run", job_file(tmp_path, checkpoint, tasks))
    table = pq.read_table(tmp_path / "out").sort_by("key")
    assert table.schema.field("embed").type == pa.list_(pa.float32(), 32)
    assert table.schema.field("e16").type == pa.list_(pa.float16(), 32)
    assert table.schema.field("classify").type == pa.string()
    assert table.schema.field("classify_scores").type == pa.list_(pa.struct([("label", pa.string()),
                                                                            ("prob", pa.float32())]))
    assert table.schema.field("clip_score").type == pa.float32()
    assert "embed_truncated" not in table.column_names
    rows = table.to_pylist()
    assert [r["status"] for r in rows] == ["ok"] * 9
    # an encoder-only model counts no tokens: no column for its own kinds, null for classify
    assert "embed_tokens" not in table.column_names and "clip_score_tokens" not in table.column_names
    assert all(r["classify_tokens"] is None for r in rows)

    model = tf.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    proc = tf.AutoProcessor.from_pretrained(checkpoint)
    loaded = [Image.open(tmp_path / "imgs" / f"{i:02d}.png").convert("RGB") for i in range(9)]
    with torch.inference_mode():
        px = proc.image_processor(images=loaded, return_tensors="pt")
        emb = model.get_image_features(**px).pooler_output
        emb = emb / emb.norm(dim=-1, keepdim=True)
        text = proc.tokenizer([f"This is a photo of {c}." for c in CHOICES], padding="max_length", max_length=64,
                              truncation=True, return_tensors="pt")
        probs = model(**px, **text).logits_per_image.softmax(-1)
        own = proc.tokenizer([f"a {c} in the picture" for c in CHOICES], padding="max_length", max_length=64,
                             truncation=True, return_tensors="pt")
        own_probs = model(**px, **own).logits_per_image.softmax(-1)
        pair = proc.tokenizer(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
        sim = torch.sigmoid(model(**px, **pair).logits_per_image.diagonal())
    assert (torch.tensor([r["embed"] for r in rows]) - emb).abs().max() < 1e-5
    assert (torch.tensor([r["e16"] for r in rows]) - emb).abs().max() < 1e-3
    assert (torch.tensor([[s["prob"] for s in r["classify_scores"]] for r in rows]) - probs).abs().max() < 1e-5
    assert [r["classify"] for r in rows] == [CHOICES[i] for i in probs.argmax(-1).tolist()]
    assert (torch.tensor([[s["prob"] for s in r["own_scores"]] for r in rows]) - own_probs).abs().max() < 1e-5
    assert (own_probs - probs).abs().max() > 1e-4  # the template is what the choices were scored in
    got = [r["clip_score"] for r in rows]
    assert got[4] is None
    assert max(abs(g - s) for i, (g, s) in enumerate(zip(got, sim.tolist())) if i != 4) < 1e-5
    assert [r["txt"] for r in rows][:2] == texts[:2]  # the kept text beside its score


@pytest.mark.parametrize("model, tasks, keep, says", [
    ("siglip", [{"caption": {}}], [], "tasks.0.caption: SigLIP is an encoder-only model"),
    ("siglip", [{"classify": {"question": "What is it?", "choices": ["a", "b"]}}], [], "tasks.0.classify.question"),
    ("demo", [{"embed": {}}], [], "tasks.0.embed: Moondream generates text; embed needs an encoder-only model"),
    ("demo", [{"similarity": {"text_column": "txt"}}], ["txt"], "tasks.0.similarity: Moondream generates text"),
    ("demo", [{"classify": {"choices": ["a", "b"]}}], [], "tasks.0.classify.question: Moondream answers a question"),
    ("siglip", [{"similarity": {"text_column": "caption"}}], [], "tasks.0.similarity.text_column: 'caption' is not "
                                                                 "in input.keep"),
])
def test_validate_refuses_in_one_line(checkpoint, tmp_path, model, tasks, keep, says):
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (20, 20)).save(tmp_path / "imgs" / "a.png")
    (tmp_path / "imgs" / "a.txt").write_text("x")
    r = cli_app(tmp_path, "validate", job_file(tmp_path, checkpoint if model == "siglip" else "demo", tasks, keep))
    assert r.returncode == 2, r.stdout
    assert says in r.stdout
    assert len([line for line in r.stdout.splitlines() if line.strip()]) == 1, r.stdout


def test_without_a_tokenizer_embed_validates_and_text_tasks_refuse_in_one_line(checkpoint, tmp_path):
    import shutil

    folder = shutil.copytree(checkpoint, tmp_path / "no_tokenizer")
    (folder / "tokenizer.json").unlink()
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (20, 20)).save(tmp_path / "imgs" / "a.png")
    r = cli_app(tmp_path, "validate", job_file(tmp_path, folder, [{"embed": {}}], keep=[]))
    assert r.returncode == 0, r.stdout
    r = cli_app(tmp_path, "validate", job_file(tmp_path, folder, [{"classify": {"choices": CHOICES}}], keep=[]))
    assert r.returncode == 2 and "tasks.0.classify: " in r.stdout and "no tokenizer.json" in r.stdout, r.stdout
    assert len([line for line in r.stdout.splitlines() if line.strip()]) == 1, r.stdout


def test_the_ray_data_udf_reads_a_similarity_text_from_the_batch(checkpoint, tmp_path):
    """integrations/ray_data.Labeler (a plain callable; no Ray here): the similarity text is the batch's
    column, the embed column has the run's type."""
    import io

    from batchvlm.integrations.ray_data import Labeler

    images = random_images(3, seed=7)
    data = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        data.append(buf.getvalue())
    job = {"name": "udf", "input": {"parquet": "x.parquet", "keep": ["caption"]}, "model": {"name": str(checkpoint)},
           "tasks": [{"embed": {}}, {"similarity": {"text_column": "caption"}}], "output": {"dir": "out"}}
    udf = Labeler(job, image_column="image")
    out = udf(pa.table({"image": data, "caption": ["a cat", None, "a dog"]}))
    assert out.schema.field("embed").type == pa.list_(pa.float32(), 32)
    sims = out.column("similarity").to_pylist()
    assert sims[1] is None and all(0 < s < 1 for s in (sims[0], sims[2]))
    assert out.column("status").to_pylist() == ["ok"] * 3
