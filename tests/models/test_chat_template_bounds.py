"""A checkpoint's chat template is an untrusted program: rendering it is bounded in time and size
(base/templates.py). A template that loops for ever, or builds gigabytes, is refused by `validate`
in one line naming the template's file, within seconds, on the native family and the
transformers backend alike; a template that fails (`raise_exception`) exits 2 on both."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file
from support.inputs import encode_image
from support.qwen3vl_fixture import CHAT_TEMPLATE, hf_config, write_host_files

from batchvlm.models.base.templates import RENDER_CHARS, RENDER_SECONDS, TemplateTooCostly, render

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
COSTLY = {  # template -> what the refusal says
    LOOPS: "takes longer than",
    "{% set x = range(100000)|list %}{% for i in x %}{% for j in x %}{% endfor %}{% endfor %}": "takes longer than",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}": "writes more than",
    "{{ 'x' * 10**9 }}": "builds a value",
    "{{ [1] * 10**9 }}": "builds a value",
    "{{ 'x'|center(1000000000) }}": "asks for a width",
    "{{ 'x'.ljust(1000000000) }}": "asks for a width",
    "{{ '{:>999999999}'.format(1) }}": "formats with a width",
    "{{ '%999999999d' % 1 }}": "formats with a width",
    "{{ 7 ** 999999 }}": "computes",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}": "builds a value",
    # a list doubled: its size is counted item by item, so on a busy machine the clock may stop it first
    "{% set ns = namespace(a=[]) %}{% for i in range(64) %}{% set ns.a = ns.a + ns.a + [i] %}{% endfor %}":
        "builds a value|takes longer than",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}": "builds a value",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": "recurses without end",
}


@pytest.mark.parametrize("source", list(COSTLY))
def test_a_costly_template_stops_within_its_bounds(source):
    start = time.monotonic()
    with pytest.raises(TemplateTooCostly, match=COSTLY[source]):
        render(source, {"messages": []})
    assert time.monotonic() - start < RENDER_SECONDS + 2


def test_a_real_template_renders_as_transformers_renders_it():
    """What the bounds leave alone: loops over messages, loop controls, transformers' generation
    tag, tojson, namespaces, a render of a few hundred kilobytes."""
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "<|{{ m['role'] }}|>{{ m['content'] }}{% set ns.n = ns.n + 1 %}{% endfor %}"
              "{% generation %}{{ ns.n }}{{ {'a': [1, 2]}|tojson }}{% endgeneration %}{{ 'y' * 300000 }}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}, {"role": "user", "content": "x"}]
    assert render(source, {"messages": messages}) == '<|user|>hi<|assistant|>ho2{"a": [1, 2]}' + "y" * 300000
    assert 300000 < RENDER_CHARS


def folder(tmp_path, template: str):
    """A Qwen3-VL checkpoint folder as validate reads it; the weights file is there (the
    transformers backend checks) but not read. The template goes into tokenizer_config.json."""
    cfg = hf_config()
    cfg.save_pretrained(tmp_path)
    save_file({"unread": torch.zeros(1)}, tmp_path / "model.safetensors")
    return write_host_files(tmp_path, cfg, template)


def validate(tmp_path, template: str, backend: str) -> subprocess.CompletedProcess:
    """`batchvlm validate` in a fresh process: a template that never ends must not hang it."""
    model = folder(tmp_path / "model", template)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(encode_image(Image.new("RGB", (64, 48)), "PNG"))
    job = {"name": "t", "input": {"folder": "imgs"}, "model": {"name": str(model), "backend": backend},
           "tasks": [{"caption": {}}], "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return subprocess.run([sys.executable, "-m", "batchvlm.cli", "validate", "job.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_validate_refuses_a_template_that_never_ends_in_one_line(tmp_path, backend):
    if backend == "transformers":
        pytest.importorskip("transformers")
    start = time.monotonic()
    r = validate(tmp_path, LOOPS + CHAT_TEMPLATE, backend)
    assert time.monotonic() - start < 60
    config = tmp_path / "model" / "tokenizer_config.json"
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"batchvlm: error: {config}: chat template: takes longer than {RENDER_SECONDS:g} s to render one prompt"], r.stderr


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_a_template_that_raises_exits_2_on_both_backends(tmp_path, backend):
    if backend == "transformers":
        pytest.importorskip("transformers")
    r = validate(tmp_path, "{{ raise_exception('this model takes no images') }}" + CHAT_TEMPLATE, backend)
    config = tmp_path / "model" / "tokenizer_config.json"
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"batchvlm: error: {config}: chat template: this model takes no images"], r.stderr
