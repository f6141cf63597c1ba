"""`batchvlm tune` on Florence-2: one fixed image size, so no budget knob; duplicate pruning after
DaViT is what it varies (issue 43: Florence-2 has a knob now, tune no longer refuses it)."""

from __future__ import annotations

import json

import pytest
from support.cli import cli_app


def test_tune_on_florence2_offers_pruning_and_refuses_a_knob(tmp_path):
    pytest.importorskip("transformers")
    import numpy as np
    import yaml
    from PIL import Image
    from support.tiny_vlms import florence2

    folder = florence2(tmp_path / "ckpt", seed=4)
    src = tmp_path / "images"
    src.mkdir()
    for i in range(4):  # flat backgrounds with one block: most footprints repeat
        a = np.full((64, 64, 3), 200 - 20 * i, dtype=np.uint8)
        a[10 + 4 * i : 30 + 4 * i, 20:44] = (200, 40, 40)
        Image.fromarray(a).save(src / f"im{i}.png")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "f", "input": {"folder": str(src)}, "model": {"name": str(folder)},
                                   "tasks": [{"caption": {}}, {"query": {"question": "What is it?"}}],
                                   "engine": {"max_new_tokens": 8}, "output": {"dir": str(tmp_path / "out")}}))
    r = cli_app(tmp_path, "tune", job, "--sample", "3", "--no-plot")  # the defaults: the full budget, prune:0
    assert r.returncode == 0, r.stdout
    data = json.loads((tmp_path / "f.tune.json").read_text())
    assert data["family"] == "florence2" and [s["setting"] for s in data["settings"]] == ["full", "prune=0"]
    full, pruned = data["settings"]
    assert full["prefix_tokens"] == 65 and pruned["prefix_tokens"] < 0.7 * full["prefix_tokens"]
    assert pruned["vision_cost"] == full["vision_cost"]  # DaViT reads every cell either way
    assert all(a["value"] == 1.0 for a in full["agreement"].values()), full["agreement"]
    r = cli_app(tmp_path, "tune", job, "--sample", "3", "--budgets", "4")
    assert r.returncode == 2 and "florence2 has no visual budget knob" in r.stdout
    assert not (tmp_path / "out").exists()
    on = tmp_path / "on.yaml"  # the job setting itself: validate accepts it for Florence-2
    on.write_text(job.read_text().replace(f"name: {folder}", f"name: {folder}\n  prune_duplicates: 0.02"))
    r = cli_app(tmp_path, "validate", on)
    assert r.returncode == 0, r.stdout
