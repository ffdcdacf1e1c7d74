"""Shared test setup: an isolated cache folder per session; GPU tests skip cleanly without a GPU."""
import os
import tempfile

import pytest

# Set before rtkernels is imported anywhere, so no test touches the user's real cache.
_TMP = tempfile.mkdtemp(prefix="rtk-test-cache-")
os.environ.setdefault("RTKERNELS_CACHE_DIR", _TMP)


def pytest_collection_modifyitems(config, items):
    from rtkernels import device
    if device.has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A new empty cache folder and clean in-process state for one test."""
    from rtkernels import cache
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_disk_off_reason", None)
    cache.clear_memory()
    cache.reset_stats()
    yield tmp_path / "cache"
    cache.clear_memory()
