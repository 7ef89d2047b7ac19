"""pytest setup shared by every test file.

- Tests marked `cuda` are skipped where torch sees no CUDA device (so `pytest` and `pytest -m cuda`
  both report them as skipped on a CPU-only machine).
- Each test gets its own random seed, derived from its node id: inputs differ from test to test
  but a failure reproduces when the test is run again.
- Where CUDA is available, every test runs with the CUDA backward's scratch poisoned
  (flash_ext.testing.poison_scratch): the fp32 dQ accumulator starts NaN-filled, so that a row whose
  zeroing was missed or came late fails the gradient checks instead of passing on a fresh
  allocation's zeros.
- A clear error when `import flash_ext` finds a source tree without the built extension.
"""
import os
import zlib

import pytest
import torch

# Slow tests run by default (CI runs them all); `-m "not slow"` leaves them out of a quick local run.
SLOW_MARKER = "slow: torch.compile and larger cases; run by default, `-m 'not slow'` leaves them out"


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated here so a copy of tests/ runs without it.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", SLOW_MARKER)
    try:
        import flash_ext  # noqa: F401
    except ImportError as error:
        raise pytest.UsageError(
            f"cannot import flash_ext ({error}). Build it first: `pip install --no-build-isolation .` and run the "
            "tests from a directory whose ./flash_ext is not the source tree (the source tree has no compiled "
            "flash_ext/_C*.so unless built in place with `python setup.py build_ext --inplace`)."
        ) from error


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="session", autouse=True)
def poison_cuda_scratch():
    """Poisoned backward scratch for the whole session, where there is a GPU (without one the setting
    would change nothing, and CPU-only runs never call the op that holds it)."""
    if not torch.cuda.is_available():
        yield
        return
    import flash_ext.testing

    with flash_ext.testing.poison_scratch(True):
        yield


@pytest.fixture(autouse=True)
def seed_from_test_id(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def compile_backend():
    """torch.compile backend for the compile tests: inductor by default; FLASH_EXT_COMPILE_BACKEND overrides."""
    return os.environ.get("FLASH_EXT_COMPILE_BACKEND", "inductor")
