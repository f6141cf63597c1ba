import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every attention test runs on one thread (tests/conftest.py one_thread: eager flex)."""
