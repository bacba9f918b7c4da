"""Session setup shared by every test module."""

import os
import signal

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per pytest-xdist worker: workers fill the cores, and OpenMP
    # threads of several workers spinning on the same cores slow every test down
    torch.set_num_threads(1)

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # a shell starts background jobs with SIGINT ignored, and processes inherit that: the
    # tests that deliver Ctrl-C (to this process or to a command they start) need it on
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items):
    """A test parametrised to run on CUDA (``device="cuda"``) is marked ``cuda``, as the tests
    written for CUDA alone are: ``pytest -m cuda`` (scripts/gpu-check) selects them all."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)
