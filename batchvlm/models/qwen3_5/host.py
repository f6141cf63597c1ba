"""Qwen3.5 (`qwen3_5`, and `qwen3_5_moe`: the same family with sparse MLPs and a shared expert)
behind the family interface (base/contract.py): the host side shared with Qwen3-VL
(qwen_vl/host.py: prompts, sequences, JSON grounding columns), this family's config, module tree
and device side. The checkpoints' chat template thinks by default; labels take its non-thinking
form (qwen_vl/prompts.py TEMPLATE_VARIABLES: an empty thinking block after the assistant header, part
of every task's own prompt)."""

from __future__ import annotations

from ..qwen_vl.host import QwenVLHost
from .config import Qwen35Config
from .device import Qwen35EngineModel
from .model import Qwen35Model


class Qwen35(QwenVLHost):
    name = "qwen3_5"
    title = "Qwen3.5"
    config_class = Qwen35Config
    model_class = Qwen35Model
    device_class = Qwen35EngineModel
    skip_prefixes = ("mtp.",)  # the multi-token prediction head of the released checkpoints: not run here
