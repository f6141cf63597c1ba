"""classify on the native Qwen3-VL and Qwen3.5 engines, dense and MoE: each choice is a row of one prefill step
that shares the image prefix and the prompt (a prefix prompt; Qwen3.5's linear-attention state at
its end is forked to every choice row); its probabilities equal those computed from transformers'
own forward log-probabilities of the choice's tokens and <|im_end|> after the same prompt, at
engine batch sizes 1, 7 and 64, pipelined and synchronous."""

from __future__ import annotations

import pytest
import torch
from support import qwen35_fixture
from support import qwen3vl_fixture
from support.qwen3vl_fixture import IDS
from support.structured_cases import CASES, assert_classify_columns
from support.qwen_vl import MOE, images, prepared

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.tasks import ClassifyTask, choice_values

pytest.importorskip("transformers")

TASKS = [ClassifyTask(classify={"question": q, "choices": c, "name": f"c{i}"}) for i, (q, c) in enumerate(CASES)]
N_IMAGES = 2
# variant -> (family, fixture, its MoE settings (None: dense), transformers class, chat template
# variables: Qwen3.5 labels non-thinking)
FAMILIES = {
    "qwen3_vl": ("qwen3_vl", qwen3vl_fixture, None, "Qwen3VLForConditionalGeneration", {}),
    "qwen3_vl_moe": ("qwen3_vl_moe", qwen3vl_fixture, MOE, "Qwen3VLMoeForConditionalGeneration", {}),
    "qwen3_5": ("qwen3_5", qwen35_fixture, None, "Qwen3_5ForConditionalGeneration", {"enable_thinking": False}),
    "qwen3_5_moe": ("qwen3_5_moe", qwen35_fixture, dict(MOE, shared=40), "Qwen3_5MoeForConditionalGeneration",
                    {"enable_thinking": False}),
}


def reference_logprobs(folder, ims, hf_class: str, template_kwargs: dict) -> list[list[list[float]]]:
    """transformers alone: chat template, image processor, pad expansion; each choice's ids in
    context after the prompt, then <|im_end|>, scored by one right-padded forward per task."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = getattr(transformers, hf_class).from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    out = []
    with torch.inference_mode():
        for im in ims:
            pix = processor(images=[im], return_tensors="pt")
            n = int(pix["image_grid_thw"].prod()) // 4
            per_task = []
            for question, choices in CASES:
                messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **template_kwargs)
                text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
                base = tok(text)["input_ids"]
                rows = [base + tok(text + c)["input_ids"][len(base):] + [IDS["<|im_end|>"]] for c in choices]
                L = max(map(len, rows))  # one right-padded forward per task: padding follows every scored row
                ids = torch.tensor([r + [IDS["<|endoftext|>"]] * (L - len(r)) for r in rows])
                mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])
                B = len(rows)
                logp = torch.log_softmax(model(
                    input_ids=ids, attention_mask=mask, pixel_values=pix["pixel_values"].repeat(B, 1),
                    image_grid_thw=pix["image_grid_thw"].repeat(B, 1),
                    mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int()).logits.float(), -1)
                scores = [float(logp[b, len(base) - 1: len(r) - 1].gather(-1, torch.tensor(r[len(base):])[:, None]).sum())
                          for b, r in enumerate(rows)]
                per_task.append(scores)
            out.append(per_task)
    return out


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """variant -> its setup, each built on first use."""
    built: dict[str, dict] = {}

    def get(variant: str) -> dict:
        if variant not in built:
            built[variant] = make_setup(variant, tmp_path_factory)
        return built[variant]
    return get


def make_setup(variant: str, tmp_path_factory) -> dict:
    name, fixture, moe, hf_class, template_kwargs = FAMILIES[variant]
    folder = fixture.write_checkpoint(tmp_path_factory.mktemp(variant), seed=2, moe=moe)
    family = open_family(ModelSpec(name=str(folder)))
    assert family.name == name and family.backend == "native"
    assert (family.config.text.moe is None) == (moe is None)
    seqs = family.sequences(TASKS, EngineSpec())
    ims = images()[:N_IMAGES]
    setup = dict(folder=folder, family=family, model=family.load("float32", "cpu"), seqs=seqs, images=ims)
    setup["prepared"] = prepared(setup)
    setup["expected"] = [[choice_values(c, lp) for (_, c), lp in zip(CASES, per_image)]
                         for per_image in reference_logprobs(folder, ims, hf_class, template_kwargs)]
    return setup


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_choices_share_the_prompt_as_a_prefix(setups, variant):
    seqs = setups(variant)["seqs"]
    assert len(seqs) == 4 + 1 + 50 and all(s.spec.budget == 1 for s in seqs)
    shared = [s.spec for s in seqs if s.task == 0]
    assert len({s.prefix_prompt for s in shared}) == 1 and all(len(s.prompt) == s.limit >= 2 for s in shared)


# Batch sizes and pipelining on the dense variants; the MoE ones (the same engine path, sparse
# MLPs) once, every choice row in one step.
RUNS = [(v, *run) for v, (_, _, moe, _, _) in FAMILIES.items()
        for run in ([(1, True, 1), (7, False, 2), (64, True, 2)] if moe is None else [(64, True, 2)])]


@pytest.mark.parametrize("variant,batch,pipelined,n_images", RUNS)
def test_probabilities_equal_transformers(setups, variant, batch, pipelined, n_images):
    setup = setups(variant)
    engine = Engine(setup["model"], setup["seqs"], EngineSpec(max_batch_size=batch, pipelined=pipelined),
                    setup["family"].max_prefix_len())
    done = {im.sample.index: [s.output for s in im.seqs]
            for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"][:n_images]))}
    assert engine.scheduler.blocks.used == 0
    rows = [setup["family"].columns(TASKS, setup["seqs"], done[i]) for i in range(n_images)]
    assert_classify_columns(rows, setup["expected"])
