"""`batchvlm tune` (issue 43 part 1): a sample of the job's images labelled at the full budget and
smaller ones, in one process; bad input refused in one line before any work; nothing written into
the job's output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import cli, cli_app
from support.inputs import good_png, write_job, write_tar

from batchvlm.data.sources import ShardRef, SourceError
from batchvlm.errors import UsageError
from batchvlm.job import InputSpec, JobError
from batchvlm.tune.agreement import Agreement, match_near, token_f1
from batchvlm.models.base.budget import Budget, halvings
from batchvlm.tune.sample import draw
from batchvlm.tune.settings import settings_for
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask


def shards(tmp: Path, n_shards: int = 2, per: int = 5) -> str:
    for s in range(n_shards):
        write_tar(tmp / f"s{s}.tar", [(f"k{s}_{i}.png", good_png(120 + 10 * i, 100 + 8 * s, (40 + 30 * i, 80, 200)))
                                      for i in range(per)])
    return str(tmp / f"s{{0..{n_shards - 1}}}.tar")


def test_tune_subprocess_reports_every_setting_and_writes_nothing_into_the_output(tmp_path):
    job = write_job(tmp_path / "job.yaml", shards(tmp_path), model={"name": "demo", "max_crops": 2},
                    tasks=[{"caption": {}}, {"query": {"question": "How many shapes are there?"}},
                           {"detect": {"objects": ["circle"]}}, {"point": {"objects": ["red circle"]}}])
    r = cli("tune", job, "--sample", "6", "--json", tmp_path / "t.json", "--plot", tmp_path / "t.png", cwd=tmp_path)
    assert "max_crops=1" in r.stdout and "prune=0" in r.stdout and "full" in r.stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert [s["setting"] for s in data["settings"]] == ["full", "max_crops=1", "prune=0"]
    assert data["sample"] == 6 and data["population"] == 10 and data["family"] == "moondream"
    full = data["settings"][0]
    assert all(a["value"] == 1.0 for a in full["agreement"].values())  # the reference agrees with itself
    assert list(full["agreement"]) == ["caption", "query", "detect", "point"]
    assert full["images_per_s"] > 0 and full["prefix_tokens"] > 0
    assert data["settings"][0]["vision_cost"] >= data["settings"][1]["vision_cost"]
    assert data["settings"][2]["prefix_tokens"] < full["prefix_tokens"]  # flat backgrounds: most tokens repeat
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, model, words", [
    (["--sample", "11"], {"max_crops": 2}, "--sample: 11 is more than the 10"),
    (["--budgets", "3"], {"max_crops": 2}, "--budgets: 3 is outside model.max_crops's range [1, 2]"),
    (["--budgets", "many"], {"max_crops": 2}, "neither an integer"),
    (["--json", "out/r.json"], {"max_crops": 2}, "out/r.json: inside the job's output folder"),
    (["--budgets", "2,"], {"max_crops": 2}, "only the full budget"),
])
def test_tune_refuses_bad_input_in_one_line_before_work(tmp_path, args, model, words):
    job = write_job(tmp_path / "job.yaml", shards(tmp_path), model={"name": "demo", **model})
    r = cli_app(tmp_path, "tune", job, *args)
    assert r.returncode == 2, r.stdout
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("batchvlm: error:") and words in lines[0], r.stdout
    assert not list(tmp_path.glob("*.tune.*"))


def test_settings_from_the_budget_and_budgets():
    b = Budget("max_pixels", 1024, 8192, halvings(8192, 1024))
    assert [s.name for s in settings_for("q", b, True, None)] == ["full", "max_pixels=4096", "max_pixels=2048",
                                                                  "max_pixels=1024", "prune=0"]
    got = settings_for("q", b, True, " 2048, prune:0.02,2048 , 8192,prune")  # repeats and the full budget: once
    assert [(s.name, s.value, s.prune) for s in got] == [("full", None, None), ("max_pixels=2048", 2048, None),
                                                         ("prune=0.02", None, 0.02), ("prune=0", None, 0.0)]
    for asked, words in [("prune:2", r"'prune:2': the tolerance must be in \[0, 1\]"),
                         ("prune:x", "must be a number"), ("512", r"512 is outside model.max_pixels's range"),
                         ("9000", "9000 is outside")]:
        with pytest.raises(UsageError, match=words):
            settings_for("q", b, True, asked)
    with pytest.raises(UsageError, match="f2 has no visual budget knob"):
        settings_for("f2", None, True, "4")
    with pytest.raises(UsageError, match="f2 cannot prune"):
        settings_for("f2", None, False, "prune")
    one = Budget("max_crops", 1, 1, ())
    with pytest.raises(JobError, match="nothing smaller to compare"):
        settings_for("m", one, False, None)
    assert [s.name for s in settings_for("moondream", one, True, None)] == ["full", "prune=0"]


def test_the_draw_is_reproducible_and_independent_of_shard_order(tmp_path):
    shards(tmp_path, 3, 4)
    refs = [ShardRef(f"s{i}", str(tmp_path / f"s{i}.tar"), "tar") for i in range(3)]
    inp = InputSpec(shards=str(tmp_path / "s0.tar"))
    a = [e.key for e in draw(refs, inp, 5, seed=0).images]
    b = [e.key for e in draw(refs[::-1], inp, 5, seed=0).images]
    c = [e.key for e in draw(refs, inp, 5, seed=1).images]
    assert a == b and len(set(a)) == 5 and a != c
    assert draw(refs, inp, 12, 0).population == 12
    assert [e.key for e in draw(refs, inp, 5, 0, exact=False).images] == a  # the default's draw is the same
    every = draw(refs, inp, 200, 0, exact=False)  # no --sample: the default, capped at what the inputs hold
    assert len(every.images) == every.population == 12
    with pytest.raises(UsageError, match="--sample: 13 is more than the 12 readable"):
        draw(refs, inp, 13, 0)
    (tmp_path / "bad.tar").write_bytes(b"not a tar")
    with pytest.raises(SourceError, match="no readable image"):
        draw([ShardRef("bad", str(tmp_path / "bad.tar"), "tar")], inp, 200, 0, exact=False)


def test_agreement_metrics():
    assert token_f1("a red circle.", "a red circle.") == 1.0
    assert token_f1("a red circle", "a blue circle") == pytest.approx(2 / 3)
    assert match_near([(0.5, 0.5), (0.9, 0.9)], [(0.52, 0.5), (0.1, 0.1)]) == 1
    tasks = [CaptionTask(caption={}), QueryTask(query={"question": "q"}), DetectTask(detect={"objects": ["x"]}),
             PointTask(point={"objects": ["y"]})]
    box = {"label": "x", "x_min": 0.1, "y_min": 0.1, "x_max": 0.5, "y_max": 0.5}
    ref = {"caption": "a b", "query": "two", "detect": [box], "point": [{"label": "y", "x": 0.2, "y": 0.2}]}
    ag = Agreement(tasks)
    ag.add(ref, ref)
    ag.add(ref, {"caption": "a c", "query": "one", "detect": [], "point": [{"label": "y", "x": 0.9, "y": 0.2}]})
    ag.add(ref, None)  # the smaller setting failed on this image: it agrees in nothing
    ag.add(None, ref)  # the full budget failed: left out
    t = {k: v["value"] for k, v in ag.table().items()}
    assert t == {"caption": pytest.approx((1 + 0.5 + 0) / 3, abs=1e-4), "query": pytest.approx(1 / 3, abs=1e-4),
                 "detect": pytest.approx(2 * 1 / (1 + 3), abs=1e-4), "point": pytest.approx(2 * 1 / (2 + 3), abs=1e-4)}


def test_tune_on_qwen_reports_max_pixels_and_pruning(tmp_path):
    pytest.importorskip("transformers")
    import numpy as np
    import yaml
    from PIL import Image
    from support.qwen3vl_fixture import write_checkpoint

    folder = write_checkpoint(tmp_path / "ckpt", seed=2, likely_stops=True)
    src = tmp_path / "images"
    src.mkdir()
    for i in range(5):  # flat backgrounds with one block: most merge groups repeat
        a = np.full((128, 160, 3), 200 - 20 * i, dtype=np.uint8)
        a[20 + 5 * i : 60 + 5 * i, 30:80] = (200, 40, 40)
        Image.fromarray(a).save(src / f"im{i}.png")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "q", "input": {"folder": str(src)}, "model": {"name": str(folder)},
                                   "tasks": [{"caption": {}}, {"detect": {"objects": ["cat"]}}],
                                   "engine": {"max_new_tokens": 12}, "output": {"dir": str(tmp_path / "out")}}))
    r = cli_app(tmp_path, "tune", job, "--sample", "4", "--budgets", "8192,prune", "--no-plot")
    assert r.returncode == 0, r.stdout
    data = json.loads((tmp_path / "q.tune.json").read_text())
    assert [s["setting"] for s in data["settings"]] == ["full", "max_pixels=8192", "prune=0"]
    full, small, pruned = data["settings"]
    assert pruned["prefix_tokens"] < full["prefix_tokens"] and small["prefix_tokens"] < full["prefix_tokens"]
    assert all(a["value"] == 1.0 for a in full["agreement"].values())
    r = cli_app(tmp_path, "tune", job, "--sample", "4", "--budgets", "999999999")
    assert r.returncode == 2 and "outside model.max_pixels's range" in r.stdout
    assert not (tmp_path / "out").exists()
