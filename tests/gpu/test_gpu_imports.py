"""The GPU tests import on the H200 image: every GPU test module (any tests/**/test_*.py marked
`gpu`), and every module it imports anywhere (a test function's imports run there too), is
imported on CPU in a subprocess whose import system finds only the standard library, this
repository's own modules (batchvlm, the tests' support code, scripts/) and the distributions of
the H200 image plus the wheels scripts/gpu_wheels.sh carries. A package missing there fails here,
before a device call is spent finding it (issue 37: jsonschema was)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu_wheels.sh").is_file())

# The H200 image's distributions (/work/.library/device/KINDS.md, "Python packages already there",
# as read on a machine on 2026-11-17). Update it when that list changes.
H200_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()
# Here, not there: what this machine's newer version of an image package imports instead (the
# image's huggingface-hub 1.33 uses httpx; 2.x here uses httpx2, which needs truststore). Not a
# package the GPU run needs.
VERSION_DRIFT = ["httpx2", "httpcore2", "truststore"]

# Run in the subprocess: argv = [allowed distributions as JSON, the GPU test files...]. It installs
# the guard, lets pytest collect the files (conftest, sys.path and module names as a real run has
# them), then imports what each collected module names in any import statement or importorskip.
GUARD = r'''
import ast, importlib, importlib.abc, importlib.machinery, importlib.metadata, importlib.util, json, re, sys, sysconfig
from pathlib import Path

import pytest

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
allowed_dists = {norm(d) for d in json.loads(sys.argv[1])}
files = sys.argv[2:]
root = Path.cwd().resolve()
outside = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *(p for p in sys.path if p.endswith("-packages")))]
dists_of = importlib.metadata.packages_distributions()
verdict = {}   # top-level name -> allowed
refused = set()


stdlib = [Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")]


def ours(top):
    """The repository's own modules (not a virtual environment inside it), and the standard
    library's modules sys.stdlib_module_names does not name (_sysconfigdata_*)."""
    spec = importlib.machinery.PathFinder.find_spec(top)
    where = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
    if not where or where in ("built-in", "frozen"):
        return False
    where = Path(where).resolve()
    if any(where.is_relative_to(o) for o in outside):
        return False
    return where.is_relative_to(root) or any(where.is_relative_to(s) for s in stdlib)


def allowed(top):
    if top not in verdict:
        verdict[top] = (top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "batchvlm"
                        or any(norm(d) in allowed_dists for d in dists_of.get(top, ())) or ours(top))
    return verdict[top]


class H200Only(importlib.abc.MetaPathFinder):
    """Wraps a finder: a module whose top-level package is not allowed is not found (find_spec None,
    as if not installed: optional imports and availability checks behave as they would there), nor
    is its distribution's metadata."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if not allowed(top):
            if top in dists_of:  # installed here
                refused.add(top)
            return None
        return self.inner.find_spec(name, path, target) if hasattr(self.inner, "find_spec") else None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """The installed metadata, likewise: only the allowed distributions' (and batchvlm's)."""
        for d in getattr(self.inner, "find_distributions", lambda context: ())(context):
            if norm(d.metadata["Name"] or "") in allowed_dists | {"batchvlm"}:
                yield d

    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()


def named_imports(module):
    """(module, names) for every import statement in the module's source, and importorskip calls."""
    tree = ast.parse(Path(module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__) \
                if node.level else node.module
            yield base, tuple(a.name for a in node.names if a.name != "*")
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant)):
            yield node.args[0].value, ()


failures = []


class ImportEverything:
    def pytest_collection_finish(self, session):
        # The test modules, then the tests' support modules they reach (code that test files shared
        # by importing each other before tests/support existed): every import in them, at any depth.
        todo = list({id(m): m for m in (item.module for item in session.items if hasattr(item, "module"))}.values())
        seen = {m.__name__ for m in todo}
        while todo:
            module = todo.pop()
            for name, attrs in named_imports(module):
                try:
                    target = importlib.import_module(name)
                    for attr in attrs:
                        if not hasattr(target, attr):
                            importlib.import_module(f"{name}.{attr}")
                except (Exception, pytest.skip.Exception) as e:  # noqa: BLE001 - report every failing import
                    failures.append(f"{module.__name__}: import {name} {attrs or ''}: {type(e).__name__}: {e}")
                    continue
                for sub in [name] + [f"{name}.{a}" for a in attrs]:
                    if sub.partition(".")[0] == "support" and sub in sys.modules and sub not in seen:
                        seen.add(sub)
                        todo.append(sys.modules[sub])


sys.meta_path[:] = [H200Only(f) for f in sys.meta_path]
sys.path.append(str(root / "scripts"))  # the GPU tests put scripts/ on the path to import its helpers
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[ImportEverything()])
print("refused (installed here, not on the image nor carried):", ", ".join(sorted(refused)) or "none")
for f in failures:
    print("IMPORT FAILS ON THE H200:", f)
sys.exit(1 if rc or failures else 0)
'''


def gpu_test_files() -> list[Path]:
    """Every test module marked gpu (module-wide `pytestmark = ...gpu...` or a test's decorator),
    wherever it lives under tests/."""
    marked = re.compile(r"^pytestmark\s*=.*\bmark\.gpu\b|^\s*@pytest\.mark\.gpu\b", flags=re.M)
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text()))


def carried() -> list[str]:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), "--list"], capture_output=True,
                         text=True, check=True).stdout
    return [re.split(r"[=<>!~\[ ]", line.strip())[0] for line in out.splitlines() if line.strip()]


def import_with_only(dists: list[str], files: list[Path]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # this machine's pytest plugins are not the image's
    return subprocess.run([sys.executable, "-c", GUARD, json.dumps(dists), *map(str, files)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


def test_the_gpu_test_modules_import_with_only_the_h200_packages_and_the_carried_wheels():
    files = gpu_test_files()
    assert any(f.name == "test_gpu.py" for f in files), files
    run = import_with_only(H200_IMAGE + VERSION_DRIFT + carried(), files)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


def test_without_jsonschema_in_the_carry_the_gpu_tests_fail_here():
    """The state issue 37 found (jsonschema not carried): the guard refuses it, the import fails."""
    run = import_with_only(H200_IMAGE + VERSION_DRIFT + [d for d in carried() if d != "jsonschema"], gpu_test_files())
    assert run.returncode != 0
    refused = re.search(r"^refused \(installed here, not on the image nor carried\): (.*)$", run.stdout, flags=re.M)
    assert refused and "jsonschema" in refused.group(1).split(", "), run.stdout[-6000:] + run.stderr[-3000:]
