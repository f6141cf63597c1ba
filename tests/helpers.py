"""Builders shared by tests: hub-like model folders, id tokenizers, tiny random models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from batchvlm.job import EngineSpec
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.host import Moondream
from batchvlm.models.moondream.device import MoondreamEngineModel
from batchvlm.models.moondream.generate import generate
from batchvlm.models.moondream.model import MoondreamModel


class LoadedMoondream:
    """Host family + loaded engine model, with the shorthands the tests use."""

    def __init__(self, name: str, revision: str | None = None, device: str = "cpu", dtype: str = "auto"):
        from batchvlm.job import ModelSpec
        from batchvlm.models.registry import open_family

        self.family: Moondream = open_family(ModelSpec(name=name, revision=revision))
        self.engine: MoondreamEngineModel = self.family.load(dtype, device)
        self.model: MoondreamModel = self.engine.model
        self.config = self.family.config
        self.preprocessor = self.family.preprocessor()
        self.P = self.family.max_prefix_len()
        self.info = self.engine.info

    def sequences(self, tasks, max_new_tokens: int = 128, max_objects: int = 50, temperature: float = 0.0,
                  top_p: float = 1.0):
        return self.family.sequences(tasks, EngineSpec(max_new_tokens=max_new_tokens, max_objects=max_objects,
                                                       temperature=temperature, top_p=top_p))

    def label(self, images, tasks, max_new_tokens: int = 128, max_objects: int = 50) -> list[dict]:
        """The simple static-batch generation, as labelled columns."""
        prepared = [self.preprocessor(im) for im in images]
        seqs = self.sequences(tasks, max_new_tokens, max_objects)
        raws = generate(self.model, prepared, [s.spec for s in seqs])
        return [self.family.columns(tasks, seqs, r) for r in raws]


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """encode("12 7") -> [12, 7]: the stand-in the parity fixtures were made with."""
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def hub_folder(dest: Path, config: dict, weights: Path | dict, tokenizer: Tokenizer | None) -> Path:
    """A folder laid out like the hub repo: wrapper config.json, model.safetensors, tokenizer.json."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": config}))
    if isinstance(weights, Path):
        shutil.copyfile(weights, dest / "model.safetensors")
    else:
        save_file(weights, str(dest / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save(str(dest / "tokenizer.json"))
    return dest


def random_state(config: MoondreamConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with non-trivial attention (the fixtures' recipe, roughly)."""
    g = torch.Generator().manual_seed(seed)
    model = MoondreamModel(config)
    out = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=g)
        if name.endswith(("ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            t = 1 + 0.05 * t
        elif name.endswith(".bias"):
            t = 0.02 * t
        elif name.endswith("qkv.weight"):
            t = 2 * t / p.shape[1] ** 0.5
        elif name.endswith(".weight"):
            t = t / p.shape[1] ** 0.5
        out[f"model.{name}"] = t.contiguous()
    return out


def write_tar(path: Path, members: list) -> Path:
    """A webdataset shard from (file name, bytes) pairs, in order; a tarfile.TarInfo is written
    as it is (a directory, a link, a device)."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def encode_image(im, fmt: str, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels but holds none (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def write_job(path: Path, shards: str, out: str = "out", **sections) -> Path:
    import yaml

    job = {"name": "test-job", "input": {"shards": shards}, "model": {"name": "demo"},
           "tasks": [{"caption": {}}, {"detect": {"objects": ["circle"]}}],
           "engine": {"max_new_tokens": 12, "max_objects": 3}, "loader": {"workers": 0},
           "output": {"dir": out}}
    for k, v in sections.items():
        job[k] = v if not isinstance(v, dict) else {**job.get(k, {}), **v}
    path.write_text(yaml.safe_dump(job))
    return path


LOAD_AND_LIST = """import sys
from batchvlm.job import ModelSpec
from batchvlm.models.registry import open_family
open_family(ModelSpec(name=sys.argv[1])).load("float32", "cpu")
print(",".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules))"""


def heavy_imports_of_loading(folder: Path) -> str:
    """Which of torch._dynamo / sympy (most of a second of start-up together) a fresh process
    imports while it opens and loads the checkpoint `folder` on the CPU: "" for none."""
    r = subprocess.run([sys.executable, "-c", LOAD_AND_LIST, str(folder)], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def inproc(cwd: Path, *args) -> tuple[int, str]:
    """The CLI app in this process: (exit code, stdout + stderr). For commands that load no model,
    and runs that are not about the process (its signals, start-up, loader workers: those are
    subprocesses); the signal handlers a run installs are put back."""
    import signal

    from typer.testing import CliRunner

    from batchvlm.cli import app

    old, handlers = os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        os.chdir(old)
        for s, h in handlers.items():
            signal.signal(s, h)
    return r.exit_code, r.output


def cli_app(cwd: Path, *args, check: bool = False) -> subprocess.CompletedProcess:
    """inproc as a finished process: its exit code, and its output as both streams."""
    code, out = inproc(cwd, *args)
    if check and code != 0:
        raise AssertionError(f"exit {code}\n{out}")
    return subprocess.CompletedProcess(args, code, out, out)
