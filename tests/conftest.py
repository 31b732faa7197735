"""Test set-up: 8 simulated CPU devices, configured before jax is imported anywhere."""

import os

from processes import FAST_COMPILE  # imports no jax

# 8 simulated devices; LLVM's optimisation off (why: `processes.FAST_COMPILE`)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Plans made by the tests never go to the user's cache: module-scoped fixtures plan into
# one fresh directory per session, and each test into its own (`fresh_plan_cache` below).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["JAXWAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxwap-test-cache-")

# One persistent compilation cache for the session's processes (both workers and the
# processes tests start, which inherit it): many tests compile the same program (a
# model's plain step, the reference each sharded step is compared with), each from a
# function object of its own, which jax's in-memory caches do not share; a fifth of the
# suite's time. Programs of every size are kept; the process that made the directory
# removes it when it ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxwap-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import random  # noqa: E402 - after the environment above, which must come first

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and machine, so a failure in CI
# reproduces here (and no example database is written into the repository).
settings.register_profile("jaxwap", derandomize=True, database=None, print_blob=True)
settings.load_profile("jaxwap")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jaxwap")
    group.addoption(
        "--planner-cores", type=int, default=None, metavar="N",
        help="the core count the planner's CPU profile sees (jaxwap.hardware.cluster."
             "host_cores), to run the suite as on a machine with N cores; default: this "
             "machine's")
    group.addoption(
        "--shuffle-seed", type=int, default=None, metavar="SEED",
        help="run the tests in an order shuffled with SEED, to show no test depends on "
             "another having run first")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        # the same seed gives every xdist worker the same order, as xdist requires
        random.Random(seed).shuffle(items)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    if config.getoption("--planner-cores") is not None:
        lines.append(f"jaxwap: the planner sees {config.getoption('--planner-cores')} cores")
    if config.getoption("--shuffle-seed") is not None:
        lines.append(f"jaxwap: test order shuffled with seed {config.getoption('--shuffle-seed')}")
    return lines


@pytest.fixture(scope="session", autouse=True)
def planner_cores(request: pytest.FixtureRequest):
    """The core count the CPU profile scales with, as `--planner-cores` sets it (the
    machine's when unset). No decision a test asserts may depend on it: those tests plan
    on fixed profiles; the rest must pass whatever the count."""
    n = request.config.getoption("--planner-cores")
    if n is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxwap.hardware.cluster.host_cores", lambda: n)
        yield n


@pytest.fixture(autouse=True)
def fresh_plan_cache(tmp_path_factory: pytest.TempPathFactory,
                     monkeypatch: pytest.MonkeyPatch):
    """Each test plans afresh: its own empty plan cache (and calibration store), so no
    test reads back a plan another test made, whatever the order they run in. Tests of
    the cache give their own directories explicitly. The analyses kept in memory
    (`graph_cache`) are forgotten too: a test that counts what a plan traces sees what a
    first plan of its step traces, whichever test traced that step before."""
    from jaxwap.analysis import graph_cache

    graph_cache.clear()
    monkeypatch.setenv("JAXWAP_CACHE_DIR", str(tmp_path_factory.mktemp("jaxwap-cache")))
