"""No host sync on the engine's hot path (STYLE 9), audited on CPU. A dispatch mode records every
op that makes the host wait for the device on CUDA: `.item()` / `bool()` (_local_scalar_dense),
data-dependent shapes (nonzero, boolean-mask indexing or assignment, masked_select) and tensors made
from Python data (`torch.tensor(...)`: a blocking upload from pageable memory on CUDA), while the
engine labels images with Moondream, Qwen3-VL, Qwen3.5 and Florence-2 through the fused attention
(CUDA's path), eager steps and the CUDA-graph decode body both. The intended wait, the emission read in
`collect`, is an event and numpy views: it dispatches nothing. The flex_attention call itself is
one compiled kernel on CUDA, so its eager CPU stand-in is not audited. (CPU-only blind spot:
`.tolist()` of a CPU tensor dispatches nothing.)"""

import sys
import traceback

import pytest
import torch
from support.moondream import LoadedMoondream, TASKS, TINY, hub_folder, id_tokenizer, random_state, run_engine
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.attention import dispatch as attention
from batchvlm.attention.fused import FusedAttention
from batchvlm.models.moondream.config import MoondreamConfig

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_thread")]
aten = torch.ops.aten
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.masked_scatter.default}


def caller() -> traceback.FrameSummary | None:
    """The innermost caller outside torch, from the audit's __torch_dispatch__."""
    frames = [f for f in traceback.extract_stack(sys._getframe(1))
              if "/torch/" not in f.filename and f.name != "__torch_dispatch__"]
    return frames[-1] if frames else None


class SyncAudit(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where, why = None, None  # the caller is looked up only for an op that may be a sync (the
        # stack and its source lines per op would be most of the tests' time)
        # Under inference_mode (the runner's), .item() and bool() reach the mode undecomposed.
        if func in (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default):
            why = ".item() / bool()"
        elif func is aten.lift_fresh.default:
            # torch.tensor(list) (a blocking pageable upload on CUDA), not from_numpy of a staged
            # array, nor the 0-dim wrap of a Python scalar argument
            if args[0].dim() > 0 and (where := caller()) is not None and "torch.tensor(" in (where.line or ""):
                why = "torch.tensor from Python data"
        elif func in DATA_DEPENDENT:
            why = str(func)
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            why = "boolean-mask index"
        if why:
            where = where or caller()
            self.found.append(f"{why} at {where.filename.split('/')[-1]}:{where.lineno} {where.name}"
                              if where else f"{why} at ?")
        return func(*args, **(kwargs or {}))


def unaudited_flex(monkeypatch):
    """The fused backend for every cache, its flex call (one kernel on CUDA) outside the audit."""
    def backend(device):
        b = FusedAttention(compile=False)
        flex = b._flex

        def kernel(*args, **kwargs):
            with _disable_current_modes():
                return flex(*args, **kwargs)

        b._flex = kernel
        return b

    monkeypatch.setattr(attention, "backend_for", backend)


def audit_graph_body_run(family, model, seqs, settings: EngineSpec, prepared: list) -> None:
    """Two images through eager steps and the graph decode body (uncaptured: the same code a
    CUDA graph records), under the audit: no sync found, and the graph body ran."""
    with SyncAudit() as audit:
        engine = Engine(model, seqs, settings, family.max_prefix_len())
        r = engine.runner
        r.graphs = r.decode_graphs(capture=False)
        done = list(engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared)))
    assert len(done) == len(prepared) and r.graph_steps > 0
    assert audit.found == [], "\n".join(dict.fromkeys(audit.found))


def test_the_audit_sees_each_kind_of_sync():
    x = torch.arange(5)
    with SyncAudit() as audit:
        (lambda: torch.tensor([1, 2]))()
        (lambda: x[x > 2].sum().item())()
        with torch.inference_mode():
            (lambda: x.max().item())()
            (lambda: bool(x.max() > 2))()
    assert [f.split(" at ")[0] for f in audit.found] == ["torch.tensor from Python data", "boolean-mask index",
                                                         ".item() / bool()", ".item() / bool()", ".item() / bool()"]


@pytest.mark.parametrize("constrained", [False, True])
def test_moondream_hot_path_has_no_host_sync(tmp_path, monkeypatch, constrained):
    """constrained: a json task as well (the mask table, its uploads, the mask before sampling)."""
    unaudited_flex(monkeypatch)
    folder = hub_folder(tmp_path / "tiny", TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    g = torch.Generator().manual_seed(4)
    prepared = [md.preprocessor(Image.fromarray(torch.randint(0, 256, (50 + 40 * i, 70, 3), generator=g,
                                                              dtype=torch.uint8).numpy())) for i in range(1)]
    tasks = TASKS
    if constrained:
        pytest.importorskip("xgrammar")
        from batchvlm.tasks import JsonTask

        tasks = [*TASKS, JsonTask(json={"prompt": "1 2", "schema": {"type": "integer"}})]  # digit tokens
    seqs = md.sequences(tasks, max_new_tokens=4, max_objects=2)
    assert any(s.spec.grammar is not None for s in seqs) == constrained
    with SyncAudit() as audit:  # engine start-up (graph buckets) and the run: eager steps and graph bodies
        run_engine(md, prepared, seqs, fixed_shape_decode=True, max_batch_size=6, pipelined=True)
    assert audit.found == [], "\n".join(dict.fromkeys(audit.found))


@pytest.mark.parametrize("moe_path,constrained", [(None, False), ("grouped", False), (None, True)])
def test_qwen3_vl_hot_path_has_no_host_sync(tmp_path, monkeypatch, moe_path, constrained):
    """Also the mixture-of-experts variant by its CUDA path, grouped GEMM (moe.py; CPU runs it too);
    constrained: a json task and output.constrain as well (the mask table, its uploads)."""
    pytest.importorskip("transformers")
    from support.qwen3vl_fixture import write_checkpoint
    from support.qwen_vl import MOE
    from support.qwen_vl import TASKS as QWEN_TASKS
    from support.qwen_vl import images

    from batchvlm.data.decode import decode
    from batchvlm.models.qwen_vl.moe import set_path
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import JsonTask
    from support.inputs import encode_image

    unaudited_flex(monkeypatch)
    folder = write_checkpoint(tmp_path / "qwen", seed=2, moe=MOE if moe_path else None)
    family = open_family(ModelSpec(name=str(folder)))
    settings = EngineSpec(max_new_tokens=3, max_batch_size=6, pipelined=True)
    if constrained:
        pytest.importorskip("xgrammar")
        QWEN_TASKS = [*QWEN_TASKS, JsonTask(json={"prompt": "Count.", "schema": {"type": "integer"}})]
    seqs = family.sequences(QWEN_TASKS, settings, constrain=constrained)
    model = family.load("float32", "cpu")
    if moe_path:
        set_path(model.model, moe_path)
    pre = family.preprocessor()
    prepared = []
    for im in images()[:2]:  # two: the padded multi-image vision layout
        d = decode(encode_image(im, "PNG"), 10**8)
        prepared.append(pre(d.image, d.width, d.height))
    with SyncAudit() as audit:
        engine = Engine(model, seqs, settings, family.max_prefix_len())
        r = engine.runner
        r.graphs = r.decode_graphs(capture=False)
        done = list(engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared)))
    assert len(done) == 2 and r.graph_steps > 0
    assert audit.found == [], "\n".join(dict.fromkeys(audit.found))


@pytest.mark.parametrize("constrained", [False, True])
def test_florence2_hot_path_has_no_host_sync(tmp_path, monkeypatch, constrained):
    """Forced first / end tokens and the n-gram ban (a per-row token history) on the device;
    constrained: a json task (the mask table, its uploads, the mask beside the ban) and a classify
    task (its scored decoder rows) as well."""
    pytest.importorskip("transformers")
    from support.florence2 import TASKS as FLORENCE_TASKS
    from support.florence2 import random_images, tasks_of
    from support.tiny_vlms import florence2

    from batchvlm.models.registry import open_family

    unaudited_flex(monkeypatch)
    folder = florence2(tmp_path / "f2", seed=1, generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
    family = open_family(ModelSpec(name=str(folder)))
    settings = EngineSpec(max_new_tokens=4, max_batch_size=6, pipelined=True)
    specs = FLORENCE_TASKS
    if constrained:
        pytest.importorskip("xgrammar")
        specs = [*FLORENCE_TASKS, {"json": {"prompt": "Count.", "schema": {"type": "integer"}}},
                 {"classify": {"question": "Is it?", "choices": ["yes", "no"]}}]
    seqs = family.sequences(tasks_of(specs), settings)
    assert any(s.spec.grammar is not None for s in seqs) == constrained
    model = family.load("float32", "cpu")
    pre = family.preprocessor()
    prepared = [pre(im) for im in random_images(2)]
    audit_graph_body_run(family, model, seqs, settings, prepared)


def test_qwen3_5_hot_path_has_no_host_sync(tmp_path, monkeypatch):
    """The linear-attention layers' runs and state indices (qwen3_5/linear_state.py), the state
    forked from each image prefix, and classify's scored prompt rows (StepInputs.score_*), eager
    steps and the graph body."""
    pytest.importorskip("transformers")
    from support.qwen35_fixture import write_checkpoint
    from support.qwen_vl import TASKS as QWEN_TASKS
    from support.qwen_vl import images

    from batchvlm.data.decode import decode
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import ClassifyTask
    from support.inputs import encode_image

    unaudited_flex(monkeypatch)
    family = open_family(ModelSpec(name=str(write_checkpoint(tmp_path / "qwen35", seed=2))))
    settings = EngineSpec(max_new_tokens=3, max_batch_size=6, pipelined=True)
    tasks = [*QWEN_TASKS[:2], ClassifyTask(classify={"question": "Which?", "choices": ["red", "red car", "blue"]})]
    seqs = family.sequences(tasks, settings)
    model = family.load("float32", "cpu")
    pre = family.preprocessor()
    prepared = [pre(d.image, d.width, d.height) for d in (decode(encode_image(im, "PNG"), 10**8)
                                                          for im in images()[:2])]
    audit_graph_body_run(family, model, seqs, settings, prepared)
