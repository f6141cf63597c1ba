"""A thinking-only Qwen checkpoint (its chat template opens `<think>` after every question, as
Qwen3-VL-*-Thinking's does, with no enable_thinking switch) is refused by `validate` in one line
naming model.name, on the native family and the transformers backend; a template that closes
the block empty with thinking off (Qwen3.5's) is not."""

from __future__ import annotations


import pytest
import torch
import yaml
from support.cli import cli_app
from support.inputs import encode_image
from PIL import Image
from support.qwen3vl_fixture import CHAT_TEMPLATE, hf_config, write_host_files
from safetensors.torch import save_file

from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base.errors import ModelLoadError
from batchvlm.models.registry import check_tasks
from batchvlm.tasks import CaptionTask

pytest.importorskip("transformers")

HEADER = "'<|im_start|>assistant\\n'"
assert HEADER in CHAT_TEMPLATE
THINKING = CHAT_TEMPLATE.replace(HEADER, "'<|im_start|>assistant\\n<think>\\n'")
# Qwen3.5's switch: thinking off writes an empty, closed block
SWITCHED = CHAT_TEMPLATE.replace(HEADER, "'<|im_start|>assistant\\n<think>\\n' + ('\\n</think>\\n\\n' if "
                                         "enable_thinking is defined and enable_thinking is false else '')")


def folder(tmp_path, template: str):
    """A checkpoint folder as validate reads it: config, tokenizer, template, processor; the
    weights file is there (the transformers backend checks) but not read."""
    cfg = hf_config()
    cfg.save_pretrained(tmp_path)
    save_file({"unread": torch.zeros(1)}, tmp_path / "model.safetensors")
    return write_host_files(tmp_path, cfg, template)


def test_validate_refuses_a_thinking_only_template_in_one_line(tmp_path):
    model = folder(tmp_path / "thinking", THINKING)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(encode_image(Image.new("RGB", (64, 48)), "PNG"))
    job = {"name": "t", "input": {"folder": "imgs"}, "model": {"name": str(model)}, "tasks": [{"caption": {}}],
           "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = cli_app(tmp_path, "validate", tmp_path / "job.yaml")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"batchvlm: error: model.name: {str(model)!r} is a thinking-only checkpoint (its chat template opens a "
        "<think> block after every question, whatever enable_thinking says); batchvlm labels with answers, not "
        "reasoning: use the model's Instruct variant"]


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_thinking_only_is_refused_and_a_switched_template_is_not(tmp_path, backend):
    def check(template: str, name: str) -> None:
        check_tasks(ModelSpec(name=str(folder(tmp_path / name, template)), backend=backend), [CaptionTask()],
                    EngineSpec())

    with pytest.raises(ModelLoadError, match="thinking-only checkpoint"):
        check(THINKING, "thinking")
    check(SWITCHED, "switched")
