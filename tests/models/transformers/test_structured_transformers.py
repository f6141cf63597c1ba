"""classify and json end to end through the transformers backend on a tiny random Qwen3-VL: one
CLI run (a batch of 4 images of different sizes, so prompts are padded) checked against
transformers' own batch-1 forward log-probabilities of each choice after the same prompt, and
every json answer that ended validates."""

import json

import jsonschema
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from support.cli import cli_app
from PIL import Image
from support.structured_cases import SCHEMAS
from support.tiny_vlms import qwen3_vl

SHARED = ["red", "red car", "reddish", "blue"]  # choices that share leading tokens
FIFTY = [f"option {i}" for i in range(50)]
QUESTION = "What is it?"
TASKS = [{"classify": {"question": QUESTION, "choices": SHARED, "name": "shared"}},
         {"classify": {"question": QUESTION, "choices": ["yes"], "name": "one"}},
         {"classify": {"question": "Which option?", "choices": FIFTY, "name": "fifty"}},
         {"json": {"prompt": "Describe it.", "schema": SCHEMAS["enums"][0], "name": "enums", "max_new_tokens": 40}},
         {"json": {"prompt": "Count them.", "schema": SCHEMAS["bounds"][0], "name": "bounds", "max_new_tokens": 40}}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("xgrammar")
    root = tmp_path_factory.mktemp("structured")
    model = qwen3_vl(root / "model", seed=1)
    (root / "imgs").mkdir()
    ims = {}
    for i in range(4):  # one batch of 4
        g = torch.Generator().manual_seed(i)
        w, h = (48 + 16 * (i % 3), 64 + 16 * (i % 2))
        ims[f"im{i}.png"] = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
        ims[f"im{i}.png"].save(root / "imgs" / f"im{i}.png")
    job = {"name": "s", "input": {"folder": "imgs"}, "model": {"name": str(model), "backend": "transformers"},
           "tasks": TASKS, "engine": {"max_batch_size": 4}, "loader": {"workers": 0}, "output": {"dir": "out"}}
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    cli_app(root, "run", root / "job.yaml", check=True)  # the CLI app in this process: transformers imported once
    rows = {row["key"]: row for row in pq.read_table(root / "out").to_pylist()}
    return model, ims, rows


def reference_logprobs(processor, model, image: Image.Image, question: str, choices: list[str]) -> list[float]:
    """transformers alone: the chat template with the image (apply_chat_template), then each
    choice's tokens written after that prompt and <|im_end|>, scored by one batch-1 forward."""
    turn = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
    enc = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    tok, end = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    with torch.inference_mode():
        for c in choices:
            ids = tok.encode(text + c, add_special_tokens=False)[len(tok.encode(text, add_special_tokens=False)):]
            ids = torch.tensor([ids + [end]])
            T = enc["input_ids"].shape[1]  # per-token inputs grow by the choice (token types: text = 0)
            full = {k: torch.cat([v, v.new_zeros(1, ids.shape[1])], 1) if v.dim() == 2 and v.shape[1] == T else v
                    for k, v in enc.items()}
            full |= {"input_ids": torch.cat([enc["input_ids"], ids], 1),
                     "attention_mask": torch.ones(1, T + ids.shape[1], dtype=torch.long)}
            logits = model(**full).logits[0, enc["input_ids"].shape[1] - 1: -1].float()
            out.append(float(torch.log_softmax(logits, -1).gather(-1, ids[0][:, None]).sum()))
    return out


def test_classify_equals_transformers_forward_log_probs(run):
    from batchvlm.tasks import choice_values

    import transformers

    from batchvlm.models.transformers_backend.processor import load_processor

    folder, ims, rows = run
    processor = load_processor(transformers, "qwen3_vl", folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    assert all(row["status"] == "ok" for row in rows.values()) and sorted(rows) == sorted(ims)
    checks = [("im1.png", "shared", QUESTION, SHARED), ("im3.png", "shared", QUESTION, SHARED),
              ("im2.png", "fifty", "Which option?", FIFTY)]
    for key, col, question, choices in checks:
        label, want = choice_values(choices, reference_logprobs(processor, model, ims[key], question, choices))
        got = rows[key][f"{col}_scores"]
        assert [s["label"] for s in got] == choices
        assert [s["prob"] for s in got] == pytest.approx([w["prob"] for w in want], abs=1e-5)
        assert rows[key][col] == label
    assert all(row["one"] == "yes" and row["one_scores"] == [{"label": "yes", "prob": 1.0}] for row in rows.values())
    assert "shared_truncated" not in next(iter(rows.values()))
    # random weights: the 50 choices are not one flat distribution, and images differ
    assert len({row["fifty"] for row in rows.values()}) > 1


def test_json_answers_that_ended_validate(run):
    _, _, rows = run
    for name in ("enums", "bounds"):
        ended = [row[name] for row in rows.values() if not row[f"{name}_truncated"]]
        assert ended, name
        for text in ended:
            jsonschema.validate(json.loads(text), SCHEMAS[name][0])
            assert text == json.dumps(json.loads(text), separators=(",", ":"))


def test_a_json_answer_whole_at_exactly_max_new_tokens_is_not_truncated(run, tmp_path):
    """The grammar decides: an answer that became whole with the last token allowed was cut by nothing."""
    folder, ims, rows = run
    lengths = {key: row["enums_tokens"]["generated"] - 1 for key, row in rows.items() if not row["enums_truncated"]}
    limit = min(lengths.values())  # the tokens of the shortest whole answer: its stop token no longer fits
    (tmp_path / "imgs").mkdir()
    for key, im in ims.items():
        im.save(tmp_path / "imgs" / key)
    task = {"json": {"prompt": "Describe it.", "schema": SCHEMAS["enums"][0], "name": "enums", "max_new_tokens": limit}}
    job = {"name": "s", "input": {"folder": "imgs"}, "model": {"name": str(folder), "backend": "transformers"},
           "tasks": [task], "engine": {"max_batch_size": 4}, "loader": {"workers": 0}, "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cli_app(tmp_path, "run", tmp_path / "job.yaml", check=True)
    again = {row["key"]: row for row in pq.read_table(tmp_path / "out").to_pylist()}
    for key, n in lengths.items():
        if n == limit:
            assert (again[key]["enums"], again[key]["enums_truncated"]) == (rows[key]["enums"], False), again[key]
            assert again[key]["enums_tokens"]["generated"] == limit
    assert all(row["enums_truncated"] for key, row in again.items() if lengths.get(key, limit + 1) > limit)
