"""Session setup shared by every test module."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per pytest-xdist worker: workers fill the cores, and OpenMP
    # threads of several workers spinning on the same cores slow every test down
    torch.set_num_threads(1)
