"""Parity with the upstream Moondream 2 reference (shared/fixtures/moondream-tiny)."""

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.moondream import LoadedMoondream, hub_folder, id_tokenizer, upstream_tasks, wanted_more
from PIL import Image
from safetensors.torch import load_file

from batchvlm.attention import AttentionBatch, PrefixGroup, SharedPrefix, TaskGroup, slot_of
from batchvlm.models.moondream.generate import encode_images, generate
from batchvlm.models.moondream.image_crops import select_tiling
from batchvlm.models.moondream.vision import n_crops

VARIANTS = ["base", "variant-text-4heads"]


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, fixtures_dir, tmp_path_factory):
    root = fixtures_dir / "moondream-tiny"
    sub = root if request.param == "base" else root / request.param
    config = json.loads((sub / "config.json").read_text())
    folder = hub_folder(tmp_path_factory.mktemp(request.param), config, root / "weights.safetensors",
                        id_tokenizer(config["text"]["vocab_size"]))
    md = LoadedMoondream(str(folder))
    expected = json.loads((sub / "expected.json").read_text())
    images = [Image.open(root / "images" / e["file"]) for e in expected["images"]]
    return md, expected, load_file(sub / "expected.safetensors"), images


def test_select_tiling_cases(tiny_expected):
    for c in tiny_expected["select_tiling_cases"]:
        got = select_tiling(c["height"] - 112, c["width"] - 112, 266, c["max_crops"])
        assert list(got) == c["tiling"], c


def test_crops_are_byte_exact(case):
    md, expected, _, images = case
    for e, im in zip(expected["images"], images):
        prepared = md.preprocessor(im)
        assert list(prepared.tiling) == e["tiling"]
        hashes = [hashlib.sha256(np.ascontiguousarray(c).tobytes()).hexdigest() for c in prepared.crops]
        if prepared.tiling == (1, 1):  # the one local crop is the global crop again; shipped once
            assert e["crops_uint8_sha256"] == hashes * 2
        else:
            assert e["crops_uint8_sha256"] == hashes


@pytest.fixture(scope="module")
def vision(case):
    """The vision encoder run once over all images: (each image's global-crop encoding, image
    features [I, T, C]); the crop encodings are read on their way through encode_images."""
    md, _, _, images = case
    prepared = [md.preprocessor(im) for im in images]
    v, encoded = md.model.vision, []

    def encode_crops(crops):
        encoded.append(type(v).encode_crops(v, crops))
        return encoded[-1]

    v.encode_crops = encode_crops
    try:
        with torch.inference_mode():
            feats = encode_images(md.model, prepared)
    finally:
        del v.encode_crops
    starts = np.cumsum([0] + [n_crops(p.tiling) for p in prepared])[:-1]
    return [encoded[0][s] for s in starts], feats


def test_image_features(case, vision):
    _, _, tensors, _ = case
    if "img0.image_features" not in tensors:
        pytest.skip("vision tensors are only in the base fixture")
    global_crops, feats = vision
    for i in range(len(global_crops)):
        torch.testing.assert_close(global_crops[i], tensors[f"img{i}.vision_global"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[i], tensors[f"img{i}.image_features"], atol=1e-4, rtol=1e-4)


def _prefill(md, features_TC, prompt):
    """Prefix + prompt through the forward primitives, one sequence -> (logits, hidden) at the end."""
    m = md.model
    P, bs, T = m.config.prefix_len, 16, len(prompt)
    nb, nown = -(-P // bs), -(-T // bs)
    cache = m.new_kv_cache(1 + nb + nown, bs)
    prefix_t, own_t = torch.arange(1, 1 + nb)[None], torch.arange(1 + nb, 1 + nb + nown)[None]
    j, lens = torch.arange(P), torch.tensor([P])
    prefix = m.prefix_embeds(features_TC[None])[0]
    batch = AttentionBatch(slot_of(prefix_t[0], j, bs), [PrefixGroup(j[None], prefix_t, lens, causal=False)], bs)
    m.forward_tokens(prefix, j, batch, cache)
    o = torch.arange(T)
    shared = SharedPrefix(prefix_t, lens, o[None], o[None])
    batch = AttentionBatch(slot_of(own_t[0], o, bs), [TaskGroup(o[None], o[None], own_t, torch.tensor([T]), shared)], bs)
    hidden = m.forward_tokens(m.text.wte[torch.tensor(prompt)], P + o, batch, cache)[-1:]
    return m.text.logits(hidden)[0], hidden[0]


@torch.inference_mode()
def test_prefill_logits_and_spatial_heads(case, vision):
    md, expected, tensors, _ = case
    _, feats = vision
    for i, e in enumerate(expected["images"]):
        logits, _ = _prefill(md, feats[i], e["caption_normal"]["prompt_ids"])
        torch.testing.assert_close(logits, tensors[f"img{i}.caption_prefill_logits"], atol=1e-4, rtol=1e-4)
        for kind in ("detect", "point"):
            _, hidden = _prefill(md, feats[i], e[kind]["prompt_ids"])
            torch.testing.assert_close(hidden, tensors[f"img{i}.{kind}_prefill_hidden_last"], atol=1e-4, rtol=1e-4)
            first_x = md.model.region.coord_logits(hidden[None])[0]
            torch.testing.assert_close(first_x, tensors[f"img{i}.{kind}_coord_logits"][0], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def generated(case):
    """The simple generation of the four tasks (max_new_tokens 20, max_objects 5, as the
    reference ran), with detect at max_objects 1 and point at the k points img3 finds beside
    them: (sequences, their specs, outputs[image][spec], k)."""
    md, expected, _, images = case
    seqs = md.sequences(upstream_tasks(expected), max_new_tokens=20, max_objects=5)
    k = len(expected["images"][3]["point"]["points"])  # img3 finds k points, then EOS
    specs = [s.spec for s in seqs]
    specs += [replace(specs[2], limit=1), replace(specs[3], limit=k)]
    return seqs, specs, generate(md.model, [md.preprocessor(im) for im in images], specs), k


def test_generation_matches_reference(case, generated):
    md, expected, _, _ = case
    seqs, specs, outs, k = generated
    for s, key in zip(seqs, ["caption_normal", "query", "detect", "point"]):
        assert list(s.spec.prompt) == expected["images"][0][key]["prompt_ids"]
    eos = md.config.tokenizer.eos_id
    for e, (cap, query, det, pt, det1, ptk) in zip(expected["images"], outs):
        assert cap.tokens == e["caption_normal"]["token_ids"]
        assert query.tokens == e["query"]["token_ids"]
        boxes = [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in e["detect"]["objects"]]
        assert len(det.objects) == len(boxes)
        np.testing.assert_allclose(np.array(det.objects).reshape(-1, 4), np.array(boxes).reshape(-1, 4), atol=1e-6)
        assert pt.objects == [(p["x"], p["y"]) for p in e["point"]["points"]]
        assert det1.objects == det.objects[:1] and ptk.objects == pt.objects[:k]
        # <name>_truncated (hit_limit) means the model wanted more than max_objects
        for out, spec, kind in zip((det, pt, det1, ptk), specs[2:], ("detect", "point", "detect", "point")):
            assert out.hit_limit(spec) == wanted_more(e, kind, spec.limit, eos), (e["file"], kind, spec.limit)
    assert len(outs[3][5].objects) == k and not outs[3][5].hit_limit(specs[5])  # exactly max_objects found: not cut


def test_labels_clamp_boxes_and_keep_model_order(case, generated):
    md, expected, _, _ = case
    seqs, _, outs, _ = generated
    rows = [md.family.columns(upstream_tasks(expected), seqs, raws[: len(seqs)]) for raws in outs]
    eos = md.config.tokenizer.eos_id
    for e, row in zip(expected["images"], rows):
        assert row["caption"] == " ".join(map(str, e["caption_normal"]["token_ids"]))
        assert [row["detect_truncated"], row["point_truncated"]] == [wanted_more(e, k, 5, eos)
                                                                    for k in ("detect", "point")]
        assert len(row["detect"]) == len(e["detect"]["objects"])
        for got, ref in zip(row["detect"], e["detect"]["objects"]):
            assert got["y_min"] == pytest.approx(min(1.0, max(0.0, ref["y_min"])), abs=1e-6)
            assert 0.0 <= got["x_min"] <= got["x_max"] <= 1.0
