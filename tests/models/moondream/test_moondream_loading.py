"""Checkpoint layout, strict loading, and hub resolution through huggingface_hub (offline)."""

import json
from pathlib import Path

import pytest
import torch
from support.moondream import LoadedMoondream, TINY, hub_folder, id_tokenizer, random_state
from PIL import Image

from batchvlm.models.base.errors import ConfigError
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.model import MoondreamModel
from batchvlm.models.base.errors import ModelLoadError
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

def test_full_size_config_matches_checkpoint_keys(fixtures_dir):
    keys = json.loads((fixtures_dir / "moondream2-keys.json").read_text())["tensors"]
    with torch.device("meta"):
        model = MoondreamModel(MoondreamConfig.from_dict({}))
    ours = {f"model.{k}": list(p.shape) for k, p in model.named_parameters()}
    assert ours == keys
    assert sum(p.numel() for p in model.parameters()) == 1927237104


def test_config_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="config.text: unknown key"):
        MoondreamConfig.from_dict({"text": {"dimm": 3}})


def _fake_hub(cache: Path, repo: str, folder_files: Path, commit: str, revision: str) -> None:
    """Lay a snapshot into a huggingface_hub cache as the library would have downloaded it."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in folder_files.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (base / "refs").mkdir()
    (base / "refs" / revision).write_text(commit)


def test_repo_id_and_folder_load_the_same_model(tmp_path, monkeypatch):
    folder = hub_folder(tmp_path / "local", TINY, random_state(MoondreamConfig.from_dict(TINY)), id_tokenizer(64))
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    _fake_hub(cache, "someone/tiny-moondream", folder, commit, "2025-06-21")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads the variable once, at import (another test module may have imported it)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    from_hub = LoadedMoondream("someone/tiny-moondream", revision="2025-06-21")
    from_dir = LoadedMoondream(str(folder))
    assert from_hub.info.revision == commit
    assert from_hub.info.weights_sha256 == from_dir.info.weights_sha256
    for (n, a), (_, b) in zip(from_hub.model.state_dict().items(), from_dir.model.state_dict().items()):
        assert torch.equal(a, b), n

    with pytest.raises(ModelLoadError, match="cannot fetch 'someone/other'"):
        LoadedMoondream("someone/other")
    with pytest.raises(ModelLoadError, match="neither a folder nor"):
        LoadedMoondream("./no/such/dir")


@pytest.mark.parametrize("damage, message", [
    ("drop", "missing 1 tensor"),
    ("extra", "unexpected 1 tensor"),
    ("shape", "has shape"),
])
def test_strict_loading_names_the_tensor(tmp_path, damage, message):
    state = random_state(MoondreamConfig.from_dict(TINY))
    name = "model.text.blocks.1.mlp.fc1.weight"
    if damage == "drop":
        del state[name]
    elif damage == "extra":
        state["model.text.rogue"] = torch.zeros(3)
    else:
        state[name] = torch.zeros(3, 3)
    folder = hub_folder(tmp_path / "m", TINY, state, id_tokenizer(64))
    with pytest.raises(ModelLoadError, match=message) as err:
        LoadedMoondream(str(folder))
    assert ("rogue" if damage == "extra" else name) in str(err.value)


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    """model-0000k-of-0000N.safetensors + model.safetensors.index.json, as the hub shards big models."""
    from safetensors.torch import save_file

    state = random_state(MoondreamConfig.from_dict(TINY), seed=4)
    single = hub_folder(tmp_path / "single", TINY, state, id_tokenizer(64))
    sharded = hub_folder(tmp_path / "sharded", TINY, {}, id_tokenizer(64))
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for k, part in enumerate(parts, 1):
        file = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: state[n] for n in part}, str(sharded / file))
        weight_map |= {n: file for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = LoadedMoondream(str(single)), LoadedMoondream(str(sharded))
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        LoadedMoondream(str(sharded))


def test_one_at_a_time_equals_sixteen_at_once(tmp_path, fixtures_dir):
    folder = hub_folder(tmp_path / "m", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=3), id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    rng = torch.Generator().manual_seed(0)
    images = []
    for i in range(16):
        w, h = 40 + 23 * i, 200 - 9 * i
        images.append(Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy()))
    tasks = [CaptionTask(caption={"length": "short"}), QueryTask(query={"question": "11 12 13"}),
             DetectTask(detect={"objects": ["20", "21 22"]}), PointTask(point={"objects": ["23"]})]
    together = md.label(images, tasks, max_new_tokens=12, max_objects=3)
    alone = [md.label([im], tasks, max_new_tokens=12, max_objects=3)[0] for im in images]
    assert together == alone
    assert any(r["detect"] for r in together) and any(r["caption"] for r in together)
