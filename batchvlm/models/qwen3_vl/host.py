"""Qwen3-VL (`qwen3_vl`, and `qwen3_vl_moe`: the same family with sparse MLPs) behind the family
interface (base/contract.py): the host side shared with Qwen3.5 (qwen_vl/host.py), this
family's config, module tree and device side."""

from __future__ import annotations

from ..qwen_vl.host import QwenVLHost
from .config import Qwen3VLConfig
from .device import Qwen3VLEngineModel
from .model import Qwen3VLModel


class Qwen3VL(QwenVLHost):
    name = "qwen3_vl"
    title = "Qwen3-VL"
    config_class = Qwen3VLConfig
    model_class = Qwen3VLModel
    device_class = Qwen3VLEngineModel
