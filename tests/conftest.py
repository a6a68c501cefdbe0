"""Shared test options: ``--run-slow`` for long variants; CUDA tests skip without a GPU; the tests
that check what the whole suite did run last."""

import pytest
import torch

# The op tests run thousands of tiny kernels: on a 2-core machine, intra-op threads only wait.
torch.set_num_threads(1)


# Every registered torch function must be reached by some test: a spy on dispatch records
# which ones are (tests/ops/test_rule_coverage.py checks at the end of a whole-suite run).
REACHED: set = set()


def _install_spy():
    from graphgrad import dispatch
    from graphgrad.rules import RULES

    def recording(func):
        if func in RULES:
            REACHED.add(func)

    dispatch.observe_calls(recording)


_install_spy()


@pytest.fixture
def no_cyclic_gc():
    """The cyclic GC off for one test: what is freed, reference counting alone freed."""
    import gc

    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the long variants marked @pytest.mark.slow")


# Files whose tests check what all the others did: run after every other test.
RUN_LAST = {"test_rule_coverage.py"}


def pytest_collection_modifyitems(config, items):
    files = {item.path for item in items}
    config.whole_suite = all(p in files for p in (config.rootpath / "tests").rglob("test_*.py"))
    items.sort(key=lambda item: item.path.name in RUN_LAST)  # stable: the others keep their order
    skip_slow = pytest.mark.skip(reason="long variant: run with --run-slow")
    skip_cuda = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
