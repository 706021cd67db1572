import faulthandler
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OLIVE_DISABLE_TELEMETRY", "1")  # Olive's usage telemetry: no network here

import pytest
from helpers import (
    CHAT_TEMPLATE,
    MODEL_ARCHES,
    drop_restored_methods,
    load_pair,
    served_live,
    shared_objects,
)

from ortmodule_dev import fixtures


def pytest_addoption(parser):
    parser.addoption("--no-cuda-graphs-by-default", action="store_true",
                     help="ortmodule.runtime.CUDA_GRAPHS_BY_DEFAULT off: the CUDA tests without the default's CUDA "
                          "graphs (to tell a failure of theirs from the code's)")


# A test still running after this many seconds has hung (the slowest, marked slow, take a few minutes on
# 2 vCPUs): the run ends there, every thread's stack on stderr, rather than at CI's time limit with no
# sign of which test it was. ORTMODULE_TEST_HANG_S=0 turns it off; pytest's own faulthandler_timeout,
# when set, takes its place (it dumps the stacks and lets the test go on).
HANG_S = float(os.environ.get("ORTMODULE_TEST_HANG_S", "900"))


def pytest_configure(config):
    if config.getoption("--no-cuda-graphs-by-default"):
        from ortmodule import runtime

        runtime.CUDA_GRAPHS_BY_DEFAULT = False
    try:  # the terminal's stderr (a test's output is captured); a runner without a file there has none
        config.hang_stderr = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        config.hang_stderr = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if HANG_S <= 0 or item.config.hang_stderr is None or float(item.config.getini("faulthandler_timeout") or 0) > 0:
        yield
        return
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=item.config.hang_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _shared_objects_as_found():
    """After each test (after its monkeypatch's undo: an autouse fixture is set up first, so torn down
    last), the shared models hold no method of their own class on the instance, whatever pytest's
    version left there (helpers.drop_restored_methods)."""
    yield
    for obj in shared_objects():
        drop_restored_methods(obj)


# What an architecture's fixture needs beyond FixtureSpec's defaults: LFM2's layer pattern (conv, conv,
# attention, conv: fixtures.ARCHITECTURES) takes four layers to hold both kinds, a convolution last; Qwen3.5's
# (linear, linear, linear, full attention) four too.
ARCH_FIELDS = {"lfm2": {"num_layers": 4}, "lfm2_moe": {"num_layers": 4}, "qwen3_5": {"num_layers": 4}}


@pytest.fixture(scope="session")
def build():
    """Build (or fetch from the cache) a fixture package: `build(arch, **spec_fields)`."""
    def _build(arch="llama", **fields):
        return fixtures.build(fixtures.FixtureSpec(arch, **{**ARCH_FIELDS.get(arch, {}), **fields}))
    return _build


@pytest.fixture(scope="session", params=MODEL_ARCHES)
def arch_pair(request, build):
    return load_pair(build(request.param))


@pytest.fixture(scope="session")
def llama(build):
    return build("llama")


@pytest.fixture(scope="module")
def openai_live(build):
    """`ortmodule serve`'s app on the llama fixture, live on 127.0.0.1, with a chat template and
    `/tokenizer_info` on:
    (server, model, transformers model, tokenizer, fixture)."""
    fixture = build("llama")
    live, model, hf, tokenizer = served_live(fixture, CHAT_TEMPLATE, tokenizer_info=True)
    yield live, model, hf, tokenizer, fixture
    live.stop()
