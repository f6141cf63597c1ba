"""Qwen3.5 parity with transformers on tiny random checkpoints the tests write (hub layout).

transformers' Qwen2-VL image processor, chat template rendering and
Qwen3_5ForConditionalGeneration (its torch fallback of the gated delta rule) are the reference:
pixel values equal, vision features and logits within float32 tolerance; the chunked prefill and
the recurrent decode reach the same state; sequences of different lengths in one flat batch
equal each run alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from support.qwen35_fixture import write_checkpoint
from support.qwen_tests import native_model, parity_case, positions, prompt_ids, reference_logits
from support.qwen_vl import ours_uint8, sample_images

from batchvlm.models.base.hub import weight_files
from batchvlm.models.qwen3_5.config import Qwen35Config
from batchvlm.models.qwen3_5.delta_rule import chunked, l2_normalize, recurrent_step_
from batchvlm.cache.spans import ZERO
from batchvlm.models.qwen3_5.linear_state import LinearState, Segments
from batchvlm.models.qwen3_5.model import Qwen35Model
from batchvlm.models.base.errors import ConfigError

transformers = pytest.importorskip("transformers")

# The delta rule's triangular solve amplifies float32 rounding, so two correct float32 orders of
# summation (transformers' and ours; one chunked pass and a split into prefix, then steps or a
# fork) differ by more than usual: measured on the base config, each of our paths is ~2e-4 (of
# hidden states up to ~7) from a float64 run of the same code, whose paths agree to 5e-13. A
# wrong state, gate or conv window is off by O(1).
SPLIT = dict(atol=1e-3, rtol=1e-3)
# Logits reach ~50 here: on the wide config ours are 2.7e-4 and transformers' 5.2e-4 from a
# float64 run of ours, 6.4e-4 from each other.
LOGITS = dict(atol=3e-3, rtol=1e-3)

CONFIGS = {
    # transformers' default pattern (every 4th layer full), 2 value heads per key head, rotary on half a head
    "base": {},
    # full layers first and last, one value head per key head, a 3-tap conv, rotary on a quarter,
    # tied embeddings, 8-px patches, a 6x6 position table, CLIP normalization
    "wide": dict(text_dim=48, heads=4, kv_heads=1, head_dim=32, layers=5, partial_rotary=0.25, section=(2, 1, 1),
                 layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention",
                              "full_attention"],
                 lin_k_heads=3, lin_v_heads=3, lin_k_dim=8, lin_v_dim=12, conv_kernel=3, vision_dim=48, depth=3,
                 pos_embeddings=36, tie=True, patch=8, seed=1,
                 mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)),
    # qwen3_5_moe: 6 experts, top 3, a shared expert, saved one tensor per expert (the text model
    # only: its tower is the dense model's)
    "moe": dict(moe=dict(experts=6, top_k=3, ff=20, shared=36), seed=3),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    moe = "moe" in CONFIGS[request.param]
    return parity_case(request.param, folder, Qwen35Config, Qwen35Model,
                       "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration", ("mtp.",))


class DenseKV:
    """Dense causal attention over one sequence, K/V kept across calls (prefill, then steps)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self.kv:
            k, v = (torch.cat([a, b]) for a, b in zip(self.kv[layer], (k, v)))
        self.kv[layer] = (k, v)
        n, T = q.shape[0], k.shape[0]
        mask = torch.ones(n, T, dtype=torch.bool).tril(T - n)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, enable_gqa=True)
        return o.transpose(0, 1)


def test_pixel_values_and_vision_features(case):
    if case["name"] == "moe":
        pytest.skip("the MoE variant's vision tower is the dense model's")
    images = sample_images()
    out = case["processor"](images=images, return_tensors="pt")
    p = case["config"].vision.patch_size
    ours = [ours_uint8(case, im) for im in images]
    rows = torch.cat([case["model"].visual.patches(u) for u in ours]).view(-1, 3, p, p)
    ref_rows = out["pixel_values"].view(-1, 3, 2, p, p)
    assert torch.equal(rows, ref_rows[:, :, 0]) and torch.equal(rows, ref_rows[:, :, 1])
    with torch.inference_mode():
        ref = case["ref"].model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        vis = case["model"].visual(ours)
    assert vis.deepstack == [] and not hasattr(case["ref"].model.visual, "deepstack_merger_list")
    assert vis.tokens == [int(n) for n in out["image_grid_thw"].prod(-1) // 4]
    torch.testing.assert_close(vis.features_TC, torch.cat(ref.pooler_output), atol=2e-5, rtol=1e-4)


def sequence(case, im, question: str):
    """One image's token ids (non-thinking template, checked against transformers' rendering),
    embeddings with the vision features in place and rotary positions; the prefix length."""
    model = case["model"]
    u = ours_uint8(case, im)
    with torch.inference_mode():
        vis = model.visual([u])
    n = vis.tokens[0]
    grid = (u.shape[0] // 32, u.shape[1] // 32) if case["config"].vision.patch_size == 16 else \
        (u.shape[0] // 16, u.shape[1] // 16)
    head, task, ids, text = prompt_ids(case, question, n, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids_t = torch.tensor(ids)
    with torch.inference_mode():
        embeds = model.embed(ids_t)
        embeds[len(head) : len(head) + n] = vis.features_TC
    return ids_t, embeds, positions(len(head), grid, len(task)), len(head) + n + 1


def forward(case, embeds, pos, kv, segments, state):
    with torch.inference_mode():
        return case["model"].text(embeds, pos, kv, segments, state)


def new_state(case, slots: int = 1) -> LinearState:
    return LinearState.allocate(case["config"].text, slots, torch.device("cpu"))


def test_logits_and_chunked_equals_recurrent(case):
    """Logits of every position match transformers'; prefilling the image prefix in one chunked
    pass and then the task tokens one recurrent step at a time gives the same hidden states and
    the same final state as one chunked pass over everything."""
    images = sample_images()  # one image and question per config: an RGB one, and a grey one
    pairs = {"base": (images[0], "Describe this image."),
             "wide": (images[6], "What is written here? Answer in one word."), "moe": (images[2], "Hi?")}
    for im, question in [pairs[case["name"]]]:
        ids, embeds, pos, P = sequence(case, im, question)
        ref = reference_logits(case, ids, im)
        whole = new_state(case)
        hidden = forward(case, embeds, pos, DenseKV(), Segments.single(len(ids), embeds.device), whole)
        torch.testing.assert_close(case["model"].logits(hidden), ref, **LOGITS)

        steps, kv = new_state(case), DenseKV()
        parts = [forward(case, embeds[:P], pos[:, :P], kv, Segments.single(P, embeds.device), steps)]
        for t in range(P, len(ids)):
            parts.append(forward(case, embeds[t : t + 1], pos[:, t : t + 1], kv, Segments.single(1, embeds.device),
                                 steps))
        torch.testing.assert_close(torch.cat(parts), hidden, **SPLIT)
        torch.testing.assert_close(steps.recurrent, whole.recurrent, **SPLIT)
        torch.testing.assert_close(steps.conv, whole.conv, **SPLIT)  # the last inputs of a later layer


def test_mixed_flat_batch_equals_each_alone(case):
    """The engine's pattern in one flat forward: fresh runs of different lengths (two whole
    sequences and an image prefix, padded together for the chunked rule), a task sequence's
    continuation that starts from the prefix's snapshot (kept) and writes its own state index;
    then one decode step. Each equals its sequence run alone. (The state bookkeeping does not
    depend on the shapes: one config.)"""
    if case["name"] != "base":
        pytest.skip("one config is enough")
    seqs = [sequence(case, im, q) for im, q in zip(sample_images()[:3], ["Describe this image.", "Hi?", "Why?"])]
    alone, states = [], []
    for ids, embeds, pos, P in seqs:
        s = new_state(case)
        alone.append(forward(case, embeds, pos, DenseKV(), Segments.single(len(ids), embeds.device), s))
        states.append(s)
    (ids0, e0, p0, _), (ids1, e1, p1, P1), (ids2, e2, p2, _) = seqs
    cut = len(ids1) - 1
    # runs (sequence, embeds, positions, read, write): seq 0 and 2 whole and seq 1's prefix from
    # zeros, then seq 1's task tokens from the prefix's snapshot (state 3) into state 1
    runs = [(0, e0, p0, ZERO, 0), (1, e1[:P1], p1[:, :P1], ZERO, 3), (2, e2, p2, ZERO, 2),
            (1, e1[P1:cut], p1[:, P1:cut], 3, 1)]
    kvs = [DenseKV(), DenseKV(), DenseKV()]
    lengths = [r[1].shape[0] for r in runs]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def attend(layer, q, k, v):
        return torch.cat([kvs[r[0]](layer, q[a : a + n], k[a : a + n], v[a : a + n])
                          for r, a, n in zip(runs, starts, lengths)])

    flat = new_state(case, 4)
    flat.recurrent.fill_(7.0)  # runs from zeros must not read their states
    segments = Segments.of(starts, lengths, [r[3] for r in runs], [r[4] for r in runs],
                           torch.zeros(0, dtype=torch.long), sum(lengths), e0.device)
    out = forward(case, torch.cat([r[1] for r in runs]), torch.cat([r[2] for r in runs], dim=1), attend, segments,
                  flat).split(lengths)
    torch.testing.assert_close(out[0], alone[0], atol=2e-5, rtol=1e-4)  # same chunk boundaries: tight
    torch.testing.assert_close(out[2], alone[2], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([out[1], out[3]]), alone[1][:cut], **SPLIT)
    snapshot = flat.recurrent[3].clone()
    step = forward(case, e1[cut:], p1[:, cut:], kvs[1], Segments.of([], [], [], [], torch.tensor([1]), 0, e1.device),
                   flat)
    torch.testing.assert_close(step, alone[1][cut:], **SPLIT)
    assert torch.equal(flat.recurrent[3], snapshot)  # the snapshot stays for other sequences
    for slot, s in ((0, states[0]), (1, states[1]), (2, states[2])):
        torch.testing.assert_close(flat.recurrent[slot], s.recurrent[0], **SPLIT)
        torch.testing.assert_close(flat.conv[slot], s.conv[0], **SPLIT)


def test_delta_rule_equals_the_transformers_torch_reference():
    """Our chunked and recurrent forms vs transformers' torch fallbacks, with a starting state and
    lengths that are not a multiple of the chunk (GQA heads are repeated by the caller)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                     torch_recurrent_gated_delta_rule)

    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 70, 3, 8, 6
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g) * 0.1
    ref_o, ref_S = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=S0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q).transpose(1, 2) * K**-0.5, l2_normalize(k).transpose(1, 2)
    o, S = chunked(qn, kn, v.transpose(1, 2), decay.transpose(1, 2), beta.transpose(1, 2), S0)
    torch.testing.assert_close(o.transpose(1, 2), ref_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(S, ref_S, atol=1e-5, rtol=1e-4)
    rec_o, rec_S = torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=S0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    St, outs = S0.clone(), []
    for t in range(T):
        outs.append(recurrent_step_(qn[:, :, t].contiguous(), kn[:, :, t].contiguous(), v[:, t], decay[:, t],
                                    beta[:, t], St))
    torch.testing.assert_close(torch.stack(outs, 1), rec_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(St, rec_S, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(St, S, atol=1e-5, rtol=1e-4)  # chunked prefill state == recurrent state


def test_bad_configs_are_refused(case):
    raw = json.loads((case["folder"] / "config.json").read_text())
    assert Qwen35Config.from_dict(raw) == case["config"]
    with pytest.raises(ConfigError, match="model_type"):
        Qwen35Config.from_dict({**raw, "model_type": "qwen3_next"})
    for path, value, match in [(("text_config", "rope_parameters", "mrope_section"), [1, 1, 1], "mrope_section"),
                               (("text_config", "layer_types"), ["full_attention"], "layer_types"),
                               (("text_config", "linear_num_value_heads"), 5, "multiple"),
                               (("vision_config", "deepstack_visual_indexes"), [0], "DeepStack")]:
        bad = json.loads(json.dumps(raw))
        at = bad
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
        with pytest.raises(ConfigError, match=match):
            Qwen35Config.from_dict(bad)
    # no layer_types: every full_attention_interval-th layer is full
    t = dict(raw["text_config"], layer_types=None, full_attention_interval=2)
    assert Qwen35Config.from_dict({**raw, "text_config": t}).text.layer_types[:2] == ("linear_attention",
                                                                                       "full_attention")


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_moe_block_paths_equal_transformers(arch):
    """One sparse MLP (6 experts, top 3; Qwen3.5-MoE's with its gated shared expert) against
    transformers' block with the same weights, by each of our expert paths: the CPU reference
    loop, the grouped GEMM CUDA runs (torch's grouped_mm has a CPU kernel too) and the gathered
    fallback. Tokens > CHUNK_ROWS / top_k, so the fallback runs several chunks."""
    from batchvlm.models.qwen_vl.config import moe_config
    from batchvlm.models.qwen_vl.moe import PATHS, SparseMoE

    C, t = 32, dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20, num_hidden_layers=1,
                    shared_expert_intermediate_size=36)
    if arch == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig as Config
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
    ref = Block(Config(hidden_size=C, **t)).eval()
    ours = SparseMoE(C, moe_config(t, shared_expert=arch == "qwen3_5_moe")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 50, C, generator=g)
    with torch.inference_mode():
        expected = ref(x)[0]
        for path in PATHS:
            ours.path = path
            torch.testing.assert_close(ours(x[0]), expected, atol=1e-5, rtol=1e-4, msg=path)


def test_expert_layouts_load_alike(case, tmp_path):
    """The per-expert checkpoint (transformers' save of Qwen3.5-MoE), rewritten with stacked
    experts in transformers' layout and in the transposed one of the released Qwen3-VL-MoE
    checkpoints, loads into the same parameters."""
    if case["name"] != "moe":
        pytest.skip("an MoE checkpoint")
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(case["folder"]):
        tensors |= load_file(f)
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    rest = {}
    for k, v in tensors.items():
        if m := per_expert.fullmatch(k):
            parts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
        else:
            rest[k] = v
    assert parts, "the fixture stores one tensor per expert"
    for transposed in (False, True):
        fused = dict(rest)
        for at, p in parts.items():
            stack = {n: torch.stack([p[n][e] for e in sorted(p[n])]) for n in p}
            gate_up, down = torch.cat([stack["gate"], stack["up"]], dim=1), stack["down"]
            fused[f"{at}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous() if transposed else gate_up
            fused[f"{at}.down_proj"] = down.transpose(1, 2).contiguous() if transposed else down
        dest = tmp_path / f"fused-{transposed}"
        dest.mkdir()
        shutil.copy(case["folder"] / "config.json", dest)
        save_file(fused, dest / "model.safetensors", metadata={"format": "pt"})
        model = native_model(case["folder"], Qwen35Model, case["config"], ("mtp.",), weights=dest)
        theirs = dict(case["model"].named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p, theirs[name]), name
