import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: one thread each, and the same for the CLI processes the
    # tests start (OMP_NUM_THREADS is inherited), or OpenMP threads oversubscribe the cores and
    # small-op CPU work slows many times over.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:  # one process: two threads, unless OMP_NUM_THREADS says (a shared machine's runs set 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))

# The shared fixtures live beside the checkout (../shared), inside it (shared/), or where
# BATCHVLM_SHARED points.
_ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [Path(os.environ["BATCHVLM_SHARED"]) / "fixtures"] if os.environ.get("BATCHVLM_SHARED") else []
_CANDIDATES += [_ROOT / "shared" / "fixtures", _ROOT.parent / "shared" / "fixtures"]
FIXTURES = next((p for p in _CANDIDATES if (p / "moondream-tiny").is_dir()), _CANDIDATES[-1])


def pytest_report_header(config):
    found = (FIXTURES / "moondream-tiny").is_dir()
    return f"batchvlm fixtures: {FIXTURES if found else 'NOT FOUND (parity tests skip; set BATCHVLM_SHARED)'}"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():  # a mark, not the folder name
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not (FIXTURES / "moondream-tiny").is_dir():
        if os.environ.get("BATCHVLM_REQUIRE_FIXTURES"):  # scripts/gpu_check.sh: a missing fixture fails
            pytest.fail(f"shared/fixtures not found (looked in {', '.join(map(str, _CANDIDATES))})")
        pytest.skip("shared/fixtures not found beside the checkout")
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_expected(fixtures_dir):
    return json.loads((fixtures_dir / "moondream-tiny" / "expected.json").read_text())


@pytest.fixture
def one_thread():
    """Eager flex runs many small ops, which two threads on a shared CPU make several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
