"""Shared test options: ``--run-slow`` for long variants; CUDA tests skip without a GPU."""

import pytest
import torch

# The op tests run thousands of tiny kernels: on a 2-core machine, intra-op threads only wait.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the long variants marked @pytest.mark.slow")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="long variant: run with --run-slow")
    skip_cuda = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
