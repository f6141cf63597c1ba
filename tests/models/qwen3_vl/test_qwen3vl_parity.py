"""Qwen3-VL parity with transformers on tiny random checkpoints the tests write (hub layout).

transformers' own Qwen2-VL image processor, chat template rendering and
Qwen3VLForConditionalGeneration are the reference: pixel values equal, vision features and
logits within float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.qwen3vl_fixture import write_checkpoint
from support.qwen_tests import parity_case, positions, prompt_ids, reference_logits
from support.qwen_vl import ours_uint8, sample_images

from batchvlm.models.qwen_vl.vision import DeepStack
from batchvlm.models.base.errors import ConfigError
from batchvlm.models.qwen_vl.preprocess import smart_resize
from batchvlm.models.qwen3_vl.config import Qwen3VLConfig
from batchvlm.models.qwen3_vl.model import Qwen3VLModel

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "base": {},
    # tied embeddings, more heads, wider rotary sections, 8-px patches, one deepstack layer,
    # CLIP normalization, a 6x6 position table
    "wide": dict(text_dim=64, heads=8, kv_heads=2, head_dim=16, section=(4, 2, 2), vision_dim=48, vision_heads=4,
                 depth=3, pos_embeddings=36, deepstack=(1,), tie=True, patch=8, seed=1,
                 mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)),
    # qwen3_vl_moe: 6 experts, top 3, a dense layer between two sparse ones (mlp_only_layers), the
    # released checkpoints' transposed expert layout (the text model only: its tower is the same)
    "moe": dict(layers=3, moe=dict(experts=6, top_k=3, ff=20, dense_layers=[1]), seed=3),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    moe = "moe" in CONFIGS[request.param]
    return parity_case(request.param, folder, Qwen3VLConfig, Qwen3VLModel,
                       "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration")


def test_smart_resize_bounds():
    assert smart_resize(448, 448, 32, 65536, 16777216) == (448, 448)
    assert smart_resize(768, 1024, 32, 65536, 16777216) == (768, 1024)
    assert smart_resize(1080, 1920, 32, 65536, 16777216) == (1088, 1920)
    h, w = smart_resize(4000, 3000, 32, 65536, 1024 * 1024)
    assert h * w <= 1024 * 1024 and h % 32 == 0 and w % 32 == 0
    h, w = smart_resize(10, 10, 32, 65536, 16777216)
    assert h * w >= 65536
    with pytest.raises(ValueError, match="aspect"):
        smart_resize(1, 300, 32, 1024, 10**6)


def text_only(case):
    if case["name"] == "moe":
        pytest.skip("the MoE variant's vision tower and host side are the dense model's")


def test_pixel_values_equal_the_processor(case):
    text_only(case)
    images = sample_images()
    out = case["processor"](images=images, return_tensors="pt")
    p = case["config"].vision.patch_size
    ref = out["pixel_values"].view(-1, 3, 2, p, p)
    ours = [ours_uint8(case, im) for im in images]
    grids = [(u.shape[0] // p, u.shape[1] // p) for u in ours]
    assert [[1, gh, gw] for gh, gw in grids] == out["image_grid_thw"].tolist()
    rows = torch.cat([case["model"].visual.patches(u) for u in ours]).view(-1, 3, p, p)
    assert torch.equal(rows, ref[:, :, 0]) and torch.equal(rows, ref[:, :, 1])


def test_vision_features(case):
    text_only(case)
    images = sample_images()
    out = case["processor"](images=images, return_tensors="pt")
    with torch.inference_mode():
        ref = case["ref"].model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        ours = case["model"].visual([ours_uint8(case, im) for im in images])
    assert ours.tokens == [int(n) for n in out["image_grid_thw"].prod(-1) // 4]
    torch.testing.assert_close(ours.features_TC, torch.cat(ref.pooler_output), atol=2e-5, rtol=1e-4)
    assert len(ours.deepstack) == len(ref.deepstack_features) > 0
    for a, b in zip(ours.deepstack, ref.deepstack_features):
        torch.testing.assert_close(a, torch.cat(b), atol=2e-5, rtol=1e-4)


def causal(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
    """Dense causal attention over one sequence (the paged engine is tested elsewhere)."""
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q_NHD, k_NHD, v_NHD)), is_causal=True,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("question", ["Describe this image.", "What is written here? Answer in one word."])
def test_prompt_tokens_and_logits(case, question):
    """The image prefix + task tokens equal transformers' chat template + pad expansion, and
    the logits of every position match."""
    if case["name"] == "moe" and question != "Describe this image.":
        pytest.skip("one question is enough")
    model = case["model"]
    images = sample_images()[:4] + sample_images()[6:8]
    if case["name"] == "moe":
        images = images[2:4]
    out = case["processor"](images=images, return_tensors="pt")
    with torch.inference_mode():
        vis = model.visual([ours_uint8(case, im) for im in images])
    start = 0
    for i, im in enumerate(images):
        n = vis.tokens[i]
        grid = (int(out["image_grid_thw"][i, 1]) // 2, int(out["image_grid_thw"][i, 2]) // 2)
        head, task, ids, _ = prompt_ids(case, question, n)
        ids_t = torch.tensor(ids)
        rows = torch.arange(len(head), len(head) + n)
        ref = reference_logits(case, ids_t, im)
        with torch.inference_mode():
            embeds = model.embed(ids_t)
            embeds[rows] = vis.features_TC[start : start + n]
            pos = positions(len(head), grid, len(task))
            hidden = model.text(embeds, pos, lambda layer, q, k, v: causal(q, k, v),
                                DeepStack(rows, [d[start : start + n] for d in vis.deepstack]))
            torch.testing.assert_close(model.logits(hidden), ref, atol=5e-5, rtol=1e-4)
        start += n


def test_bad_configs_are_refused(case, tmp_path):
    import json

    text_only(case)
    raw = json.loads((case["folder"] / "config.json").read_text())

    with pytest.raises(ConfigError, match="model_type"):
        Qwen3VLConfig.from_dict({**raw, "model_type": "qwen2_5_vl"})
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [1, 1, 1]
    with pytest.raises(ConfigError, match="mrope_section"):
        Qwen3VLConfig.from_dict(bad)
    # the released checkpoints' spelling: rope_theta + rope_scaling
    old = json.loads(json.dumps(raw))
    rope = old["text_config"].pop("rope_parameters")
    old["text_config"]["rope_theta"] = rope["rope_theta"]
    old["text_config"]["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert Qwen3VLConfig.from_dict(old) == case["config"]
