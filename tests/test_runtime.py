"""mtpjax.parallel.runtime: the cache root, the persistent compilation cache across runs, train.profile traces."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import memory_maps, release_compiled_programs
from train_helpers import cli_args, tiny_cfg, write_corpus

from mtpjax.parallel import runtime
from mtpjax.config import ConfigError, load_config, parse_profile

REPO = Path(__file__).resolve().parent.parent
SHORT = ["model.n_layers=1", "model.mtp_depth=1", "data.seq_len=16", "train.batch_size=4", "train.eval_batches=0",
         "train.steps=2", "checkpoint.async_save=false"]
# train.py with a listener counting JAX's monitoring events, printed as one JSON line at exit
COUNTING = ("import atexit, collections, json, runpy, sys; import jax.monitoring as m; c = collections.Counter(); "
            "m.register_event_listener(lambda e, **k: c.update([e])); "
            "atexit.register(lambda: print('EVENTS ' + json.dumps(c), file=sys.stderr)); "
            "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")


def test_cache_root_is_one_place(monkeypatch, tmp_path):
    from mtpjax.decode.autodraft import default_calibration_file

    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    assert runtime.cache_root() == tmp_path and runtime.compilation_cache_dir() == tmp_path / "xla"
    assert default_calibration_file() == tmp_path / "decode_calibration.json"
    monkeypatch.delenv("MTPJAX_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime.cache_root() == tmp_path / "home" / ".cache" / "mtpjax"


def test_releasing_compiled_programs_unmaps_them():
    """Why the suite can run in one process: each compiled program holds memory maps until the jit caches let go,
    and conftest lets go after every module. Companion: holding the programs keeps their maps."""

    @jax.jit
    def f(x):
        return jnp.sin(x).sum()

    def compile_40():  # 40 shapes, 40 executables
        for n in range(1, 41):
            f(jnp.ones((2, n))).block_until_ready()

    compile_40()  # the first compiles of a process also map what stays (allocator arenas, ~70 maps): not counted
    release_compiled_programs()
    base = memory_maps()
    compile_40()
    held = memory_maps()
    assert held > base + 120, (base, held)  # each executable maps several regions (~280 here)
    release_compiled_programs()
    assert memory_maps() - base < (held - base) / 4, (base, held, memory_maps())  # 0 here


UNOPTIMIZED = "jax_disable_most_optimizations"


def _unoptimized_in_a_child() -> bool:
    """Whether a process this test starts (train.py, decode.py, a worker) compiles with XLA's optimizations off."""
    p = subprocess.run([sys.executable, "-c", f"import jax; print(jax.config.values['{UNOPTIMIZED}'])"],
                       capture_output=True, text=True, timeout=120, check=True)
    return p.stdout.strip() == "True"


def test_a_default_tier_test_compiles_as_users_do_in_a_full_run():
    """Companion of the next: outside the slow tier nothing turns XLA's optimizations off (the default tier's own
    run lowers only LLVM's level, by XLA_FLAGS)."""
    assert not jax.config.values[UNOPTIMIZED] and not _unoptimized_in_a_child()


@pytest.mark.slow
def test_a_slow_test_of_a_full_run_compiles_unoptimized_here_and_in_its_processes():
    import conftest

    assert conftest._unoptimized_slow  # a run that selects the slow tier
    assert jax.config.values[UNOPTIMIZED] and _unoptimized_in_a_child()


def _events(run: str, tmp: Path, corpus: Path, *extra: str) -> dict:
    cfg = tiny_cfg(tmp, *SHORT, *extra, corpus=corpus, run=run)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTPJAX_CACHE_DIR": str(tmp / "cache-root")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run([sys.executable, "-c", COUNTING, *cli_args(cfg)], check=False, cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("EVENTS "))
    events = json.loads(line[len("EVENTS "):])
    return {k.rsplit("/", 1)[1]: v for k, v in events.items() if k.startswith("/jax/compilation_cache/")}


@pytest.mark.slow
def test_second_run_reads_every_program_from_the_compilation_cache(tmp_path):
    """Run 1 compiles and writes the cache; run 2 (same config, another run dir) compiles nothing: every compile
    request is a cache hit. The cache lives under $MTPJAX_CACHE_DIR, never in a run directory. Companion: run 3
    with train.compilation_cache=false reads nothing from the same, full cache."""
    corpus = write_corpus(tmp_path)
    first = _events("a", tmp_path, corpus)
    assert first["cache_misses"] == first["compile_requests_use_cache"] >= 2 and first.get("cache_hits", 0) == 0
    entries = sorted(p.name for p in (tmp_path / "cache-root" / "xla").iterdir())
    assert any(n.startswith("jit_train_step-") for n in entries), entries
    second = _events("b", tmp_path, corpus)
    assert second["cache_hits"] == second["compile_requests_use_cache"] == first["compile_requests_use_cache"]
    assert second.get("cache_misses", 0) == 0
    for run in ("a", "b"):
        assert not [p for p in (tmp_path / run).rglob("*") if p.name.endswith("-cache") or p.name == "xla"]
    off = _events("c", tmp_path, corpus, "train.compilation_cache=false")
    assert off.get("cache_hits", 0) == 0
    assert sorted(p.name for p in (tmp_path / "cache-root" / "xla").iterdir()) == entries


def test_profile_window_parses_and_refuses_bad_values(tmp_path):
    assert parse_profile("") is None and parse_profile("10:15") == (10, 15) and parse_profile(" 0 : 2 ") == (0, 2)
    # YAML would read 10:15 as the base-60 integer 615; the loader keeps it a string, on the command line and in files
    assert load_config(None, ["train.profile=10:15"]).train.profile == "10:15"
    (tmp_path / "c.yaml").write_text("train:\n  profile: 10:15\n")
    assert load_config(tmp_path / "c.yaml").train.profile == "10:15"
    assert load_config(None, ["train.steps=1_000"]).train.steps == 1000  # other integers still read as before
    for bad in ("5:5", "7:3", "3", "a:b", "-1:4"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"train.profile={bad}"])
        assert "train.profile" in str(e.value) and "start:stop" in str(e.value) and "\n" not in str(e.value)
    # a window starting at or past the last step traced nothing and said nothing
    assert load_config(None, ["train.steps=11", "train.profile=10:15"]).train.profile == "10:15"
    with pytest.raises(ConfigError, match=r"^config key 'train.profile' = '10:13' .*\(train.steps=10\), so nothing"):
        load_config(None, ["train.steps=10", "train.profile=10:13"])


def test_profiler_traces_the_window_only(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(runtime.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(runtime.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    prof = runtime.Profiler("2:4", "/tmp/nowhere-profile")
    for done in range(6):
        prof.step(done, None)
        calls.append(done)
    prof.close(6, None)
    assert calls == [0, 1, ("start", "/tmp/nowhere-profile"), 2, 3, ("stop",), 4, 5]
    assert "profile of steps 3..4 written" in capsys.readouterr().err
    resumed = runtime.Profiler("2:4", "/tmp/nowhere-profile")
    calls.clear()
    resumed.step(3, None)  # a run resumed inside the window traces the rest of it
    resumed.close(3, None)  # and one that ends inside it stops the trace at its end
    assert calls == [("start", "/tmp/nowhere-profile"), ("stop",)]
    calls.clear()
    runtime.Profiler("", "/x").step(0, None)
    assert calls == []


def test_train_profile_writes_a_trace_tensorboard_reads(tmp_path):
    from mtpjax.train.loop import train

    cfg = tiny_cfg(tmp_path, *SHORT, "train.steps=3", "train.profile=1:2")
    train(cfg)
    traces = list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert b"train_step" in traces[0].read_bytes()  # the traced window holds a train step
    page = _overview_page(traces[0])  # what TensorBoard's profile tab (XProf) shows first
    assert "No step marker" not in page and float(_json_field(page, "steptime_ms_average")) > 0


def _overview_page(trace: Path) -> str:
    """XProf's overview page (JSON text) of one .xplane.pb, as TensorBoard's profile plugin computes it."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], "overview_page", {})
    return data if isinstance(data, str) else data.decode()


def _json_field(text: str, key: str) -> str:
    return text.split(f'"{key}":"', 1)[1].split('"', 1)[0]


def test_a_trace_without_step_annotations_has_no_step_time(tmp_path, monkeypatch):
    """The companion: the step markers, not the trace itself, are what gives XProf its step time."""
    import contextlib

    from mtpjax.train.loop import train

    monkeypatch.setattr(runtime.Profiler, "annotate", lambda self, step: contextlib.nullcontext())
    train(tiny_cfg(tmp_path, *SHORT, "train.steps=3", "train.profile=1:2"))
    (trace,) = (tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb")
    page = _overview_page(trace)
    assert "No step marker" in page and float(_json_field(page, "steptime_ms_average")) == 0


@pytest.mark.slow
@pytest.mark.as_users_compile
def test_a_slow_test_marked_as_users_compile_keeps_the_production_settings():
    assert not jax.config.values[UNOPTIMIZED] and not _unoptimized_in_a_child()
