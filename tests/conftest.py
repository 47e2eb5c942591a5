"""Shared fixtures: small float32 models only (2 shared CPU cores); implicit rank promotion is an error.

One cache root per session ($MTPJAX_CACHE_DIR, a temporary directory, not the user's ~/.cache): decode
calibrations and the persistent compilation cache live there, so the tiny programs that many tests compile
(here and in the train.py / decode.py processes they start) are compiled once. One trained run (`tiny_run`)
is shared by the tests that only need a run directory.
"""

import atexit
import collections
import gc
import os
import shutil
import tempfile

from mtpjax.parallel.targets import prepare_environment

# Before JAX loads, here and (by the environment) in the processes tests start: the CPU backend only, and no cloud
# metadata query from libtpu where the `tpu` extra is installed.
prepare_environment("cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from mtpjax.parallel import runtime  # noqa: E402
from mtpjax.config import ModelConfig  # noqa: E402

# A [B,T,D] array meeting a [D] one must say how it broadcasts: silent rank promotion hides shape bugs.
jax.config.update("jax_numpy_rank_promotion", "raise")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # and in the train.py / decode.py / worker subprocesses

# Set before anything compiles; the environment carries the cache root to subprocesses, whose train.py and
# decode.py turn the compilation cache on there themselves.
_CACHE_ROOT = tempfile.mkdtemp(prefix="mtpjax-tests-cache-")
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
os.environ["MTPJAX_CACHE_DIR"] = _CACHE_ROOT
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # a user's own cache directory would win over the session's
runtime.enable_compilation_cache(True)

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, mtp_depth=2)
# The shared run: 7 steps, checkpoints every 2 keeping 3, so [4, 6, 7] (7: a run always saves its last step).
TINY_RUN = ["train.steps=7", "train.eval_batches=0", "train.eval_every=1000", "checkpoint.every=2",
            "checkpoint.keep=3", "checkpoint.async_save=false"]


# The README's own jobs: in every run they compile as users do (the main job's 500 training steps run faster so), as
# does a slow test marked as_users_compile (a bitwise equality between two programs that holds as users compile).
AS_USERS_COMPILE = {"test_main_job.py", "test_quickstart.py"}
_unoptimized_slow = False  # set by pytest_configure: a run that selects the slow tier


def pytest_configure(config):
    """Compile settings by tier. The default tier compiles hundreds of tiny programs, most of them once, where LLVM's
    optimizer costs more time than it saves: it compiles them unoptimized (a third faster). A run that selects the
    slow tests (CI's full suite) compiles the default tier's tests as users do, so every equality of that tier is
    also checked at XLA's production settings, and the slow tests themselves (repeated variants, whole runs)
    unoptimized (`_slow_tests_compile_unoptimized`; a quarter less time), except the README's own jobs."""
    global _unoptimized_slow
    flags = os.environ.get("XLA_FLAGS", "")
    if config.getoption("markexpr") == "not slow" and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()  # subprocesses inherit it
    else:
        _unoptimized_slow = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") is None  # a user's own choice wins


@pytest.fixture(autouse=True)
def _slow_tests_compile_unoptimized(request, monkeypatch):
    """A slow test of a full run compiles with jax_disable_most_optimizations, here and (by the environment) in the
    processes it starts; a module's fixtures built before it keep the settings they were compiled with."""
    if not (_unoptimized_slow and request.node.get_closest_marker("slow")
            and request.path.name not in AS_USERS_COMPILE and not request.node.get_closest_marker("as_users_compile")):
        yield
        return
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


# Test files that share a costly session fixture run in one xdist worker, so it is built once (quickstart_run:
# ~10 minutes of training on 2 cores).
SAME_WORKER = {"test_main_job.py": "quickstart", "test_quickstart.py": "quickstart"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (pyproject's addopts) a test file is one unit of work, as `loadfile` makes it, so its
    module-scoped programs compile once; the files in SAME_WORKER share one unit, handed out first. Runs before xdist
    reads the marks."""
    unit = lambda item: SAME_WORKER.get(item.path.name, item.path.name)
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(unit(item)))
    # Workers take units in this order (addopts has --no-loadscope-reorder): the quickstart's ~12 serial minutes
    # first (handed out last, by xdist's own order of most tests first, they were CI's tail), then most tests first.
    counts = collections.Counter(map(unit, items))
    items.sort(key=lambda item: (item.path.name not in SAME_WORKER, -counts[unit(item)]))


def memory_maps() -> int:
    """How many memory regions this process has mapped (Linux caps it at vm.max_map_count, 65530 by default)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def release_compiled_programs() -> None:
    """Drop every compiled program JAX holds; the persistent cache gives back any a later test needs."""
    jax.clear_caches()
    gc.collect()


def record_builds(monkeypatch) -> list[str]:
    """From here on, one entry per corpus build (tokenizing a source into a cache entry): the thread that ran it."""
    import threading

    from mtpjax.data import corpus

    builds, real = [], corpus._build
    monkeypatch.setattr(corpus, "_build", lambda *a: (builds.append(threading.current_thread().name), real(*a))[1])
    return builds


@pytest.fixture
def corpus_builds(monkeypatch) -> list[str]:
    """The corpus builds during the test (see record_builds): a cache hit adds none."""
    return record_builds(monkeypatch)


@pytest.fixture(autouse=True, scope="module")
def _one_module_of_programs_at_a_time():
    """Free a module's compiled programs when it ends. XLA:CPU maps ~6 regions per executable and keeps them while a
    jit cache holds it, so the whole suite in one process (CI) reached vm.max_map_count and segfaulted mid-compile."""
    yield
    release_compiled_programs()


@pytest.fixture
def model_cfg():
    """Factory: a tiny float32 ModelConfig; keyword arguments override its fields."""
    def make(**kw) -> ModelConfig:
        return ModelConfig(**{**SMALL, **kw})
    return make


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(cfg, run dir) of a trained tiny run with checkpoints 4, 6, 7; read-only: copy it before changing it."""
    from train_helpers import tiny_cfg

    from mtpjax.train.loop import train

    tmp = tmp_path_factory.mktemp("tiny_run")
    cfg = tiny_cfg(tmp, *TINY_RUN)
    train(cfg)
    return cfg, tmp / "run"


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """(run dir, train.py's stderr): configs/tiny.yaml trained by the README's own train command (slow tests only:
    ~10 minutes on 2 cores), shared by test_main_job and test_quickstart so the slow tier trains it once."""
    import subprocess
    import sys

    from readme_quickstart import ROOT, command

    run = tmp_path_factory.mktemp("quickstart") / "tiny"
    argv = [sys.executable, *command("train.py")[1:], f"train.run_dir={run}", "train.progress=false"]
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-2000:]
    return run, res.stderr
