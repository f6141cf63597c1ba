"""The prefill budget of an admission step: the per-device rule (engine/prefill.py), the job's
setting over it, and the scheduler admitting by it."""

import torch
from PIL import Image
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state, run_engine

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.engine.plan import PREFILL_TOKENS_PER_STEP
from batchvlm.engine.prefill import MAX_TOKENS, MIN_TOKENS, PREFILL_DECODE_STEPS, prefill_budget
from batchvlm.job import EngineSpec
from batchvlm.models.moondream.config import MoondreamConfig


def test_an_h200_budget_is_n_decode_steps_of_prefill():
    # Moondream 2 at 256 rows (issue 37): 3.7 GB of weights, ~5 GB of prefix K/V per decode step.
    got = prefill_budget("NVIDIA H200", torch.bfloat16, int(3.7e9), int(5e9))
    decode_s = (3.7e9 + 5e9) / 4.8e12
    token_s = 2 * (3.7e9 / 2) / 989e12
    assert abs(got - PREFILL_DECODE_STEPS * decode_s / token_s) <= 256 and got % 256 == 0
    assert 3500 <= got <= 4096
    # Weights alone: the device's ridge point per decode step, whatever the model.
    ridge = PREFILL_DECODE_STEPS * 989e12 / 4.8e12
    for w in (1e9, 8e9):
        assert abs(prefill_budget("NVIDIA H200", torch.bfloat16, int(w), 0) - max(ridge, MIN_TOKENS)) <= 256
    # A slower memory (H100 SXM) spends more prefill per decode step; float32 (no TF32) much less.
    assert prefill_budget("NVIDIA H100 80GB HBM3", torch.bfloat16, int(3.7e9), int(5e9)) > got
    assert prefill_budget("NVIDIA H200", torch.float32, int(7.4e9), int(10e9)) == MIN_TOKENS
    assert prefill_budget("NVIDIA H200", torch.bfloat16, int(1e9), int(1e12)) == MAX_TOKENS


def test_unknown_devices_keep_the_default():
    assert prefill_budget("Some GPU", torch.bfloat16, int(3.7e9), int(5e9)) == PREFILL_TOKENS_PER_STEP
    assert prefill_budget("NVIDIA H200", torch.bfloat16, 0, int(5e9)) == PREFILL_TOKENS_PER_STEP


def test_the_job_setting_sets_the_budget_and_the_scheduler_admits_by_it(tmp_path):
    folder = hub_folder(tmp_path / "tiny", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5), id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    seqs = md.sequences(TASKS, max_new_tokens=4, max_objects=2)
    g = torch.Generator().manual_seed(3)
    prepared = [md.preprocessor(Image.fromarray(torch.randint(0, 256, (40, 60, 3), generator=g,
                                                              dtype=torch.uint8).numpy())) for _ in range(4)]
    default = Engine(md.engine, seqs, EngineSpec(max_batch_size=64), md.P)
    assert default.stats["prefill_tokens"] == default.scheduler.prefill_tokens == PREFILL_TOKENS_PER_STEP  # CPU
    one = Engine(md.engine, seqs, EngineSpec(max_batch_size=64, prefill_tokens_per_step=1), md.P)
    assert one.stats["prefill_tokens"] == one.scheduler.prefill_tokens == 1
    prefixes = []
    launch = one.runner.launch
    one.runner.launch = lambda plan: (prefixes.append(len(plan.prefix_features)), launch(plan))[1]
    list(one.run(Sample(0, i, str(i), p) for i, p in enumerate(prepared)))
    assert max(prefixes) == 1 and sum(prefixes) == len(prepared)  # one image per step: the budget, at least one
    assert (run_engine(md, prepared, seqs, max_batch_size=64, prefill_tokens_per_step=1)
            == run_engine(md, prepared, seqs, max_batch_size=64))
