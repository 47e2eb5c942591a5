"""bench.ablation: the grid, fair comparisons (same shared init, same batches, D=0 at equal FLOPs), the report,
bad input, and the sweep's train.py semantics (killed and re-run == uninterrupted)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import write_corpus

from bench.ablation import grid, report, sweep
from bench.ablation.__main__ import SMOKE, main
from mtpjax.train import loop as train_loop
from mtpjax.config import load_config, replace
from mtpjax.eval.log import append_eval, read_evals
from mtpjax.nn.model import MTPModule, MTPTransformer, build_model
from mtpjax.nn.placement import host_placement
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import make_programs

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "ablation.yaml")


def _data(tmp: Path) -> list[str]:
    corpus = tmp / "corpus.txt" if (tmp / "corpus.txt").exists() else write_corpus(tmp)
    return ["data.source=text", f"data.paths={corpus}", f"data.cache_dir={tmp / 'cache'}", "data.val_fraction=0.1"]


def _base(tmp: Path, *over: str):
    return load_config(CONFIG, SMOKE + _data(tmp) + list(over))


def _shared(state_or_model) -> dict[str, bytes]:
    """Path -> bytes of every parameter outside the MTP modules (trunk, embedding, head, final norm)."""
    st = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(st)[0]
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in flat if "'mtp'" not in jax.tree_util.keystr(p)}


# ----------------------------------------------------------------------------- same initialization of the shared parts


@pytest.mark.slow
def test_shared_parameters_start_identical_in_every_variant(tmp_path):
    base = _base(tmp_path)
    vs = grid.variants([0, 1, 2], {"sequential": [1, 2], "parallel": [1, 2]}, ["constant:0.3"])
    mesh = make_mesh(base.mesh)
    inits = {}
    for v in vs:  # the jitted sharded init the train loop uses
        cfg = grid.variant_config(base, v, 0, 8, tmp_path / v.name)
        inits[v.name] = _shared(make_programs(cfg, mesh).init().params)
    ref = inits["d0"]
    assert len(ref) > 10 and any("embed" in k for k in ref) and any("blocks" in k for k in ref)
    for name, shared in inits.items():
        assert shared == ref, name
    other_seed = _shared(build_model(grid.variant_config(base, vs[0], 1, 8, tmp_path).model, seed=1))
    assert other_seed != ref


def test_companion_mtp_modules_created_first_would_change_the_trunk(tmp_path):
    """What the test above guards: the trunk draws its parameters before any MTP module from the same Rngs."""
    m = grid.variant_config(_base(tmp_path), grid.Variant(2, "sequential", "constant:0.3"), 0, 8, tmp_path).model
    rngs = nnx.Rngs(params=0)
    MTPModule(m, rngs, host_placement())  # an MTP module drawn first shifts every later draw
    broken = MTPTransformer(m, rngs=rngs)
    assert _shared(broken) != _shared(build_model(m, seed=0))


# ----------------------------------------------------------------------------- the grid


def test_grid_curve_mode_one_d0_run_read_at_every_flop_point(tmp_path):
    base = _base(tmp_path)
    assert base.optim.schedule == "constant" and grid.mode(base) == "curve"
    vs = grid.variants([0, 1, 2], grid.parse_kinds("sequential,parallel@2", [0, 1, 2]), ["constant:0.3"])
    assert [v.name for v in vs] == ["d0", "d1-seq-constant_0.3", "d2-seq-constant_0.3", "d2-par-constant_0.3"]
    eq = grid.equal_flops_steps(base, vs, 100)
    f0 = grid.flops_per_token(replace(base, ["model.mtp_depth=0"]))
    for v in vs[1:]:
        fv = grid.flops_per_token(replace(base, [f"model.mtp_depth={v.depth}", f"model.mtp_kind={v.kind}"]))
        assert eq[v.name] == round(100 * fv / f0) > 100
    runs = grid.plan_runs(base, vs, [0, 1], 100, tmp_path / "out")
    assert len(runs) == 8 and [r.seed for r in runs] == [0] * 4 + [1] * 4
    d0 = runs[0]
    assert d0.steps == max(eq.values()) and d0.stops == tuple(sorted({100, *eq.values()}))
    assert all(r.steps == 100 and r.stops == (100,) for r in runs if r.variant.depth)
    assert runs[5].dir == tmp_path / "out" / "seed1" / "d1-seq-constant_0.3"
    assert runs[5].cfg.train.seed == 1 and str(runs[5].cfg.loss.mtp_lambda) == "constant:0.3"
    assert grid.d0_run_at(runs, 1, eq["d2-par-constant_0.3"]) is runs[4]


def test_grid_separate_mode_gives_each_flop_point_its_own_schedule(tmp_path):
    base = _base(tmp_path, "optim.schedule=cosine")
    vs = grid.variants([0, 2], grid.parse_kinds("sequential,parallel", [0, 2]), ["constant:0.3", "linear:0.3->0.1@50"])
    assert len(vs) == 5 and grid.mode(base) == "separate"
    runs = grid.plan_runs(base, vs, [0], 100, tmp_path)
    eq = grid.equal_flops_steps(base, vs, 100)
    d0s = [r for r in runs if r.variant.depth == 0]
    assert [r.steps for r in d0s] == [100, *sorted(set(eq.values()))]
    for n in eq.values():
        r = grid.d0_run_at(runs, 0, n)
        assert r.steps == n and r.stops == (n,) and r.dir.name == ("d0" if n == 100 else f"d0-steps{n}")


# ----------------------------------------------------------------------------- the report


def _fake_evals(runs, seeds_offset=0.0, task=False):
    """Eval logs whose loss/main (and task metric) is a known function of (depth, kind, seed, step)."""
    for r in runs:
        r.dir.mkdir(parents=True, exist_ok=True)
        v = r.variant
        for step in sorted({*range(0, r.steps + 1, r.cfg.train.eval_every), *r.stops} - {0}):
            loss = 3.0 - 0.1 * v.depth - 0.05 * (v.kind == "parallel") * (v.depth > 0) + 0.01 * r.seed - 0.001 * step
            rec = {"loss/main": loss, "bits_per_byte": loss / np.log(2) * 1.01}
            if task:  # D=1: +0.2 / +0.5 by seed (spread too wide); D=2: +0.4 / +0.45 (pays)
                rec["task/induction_accuracy"] = 0.1 + 0.2 * v.depth + (0.3 if v.depth == 1 else 0.05) * r.seed * (
                    v.depth > 0)
            for k in range(1, v.depth + 1):
                rec |= {f"loss/mtp_{k}": loss + k, f"agreement/mtp_{k}": 0.5 / k}
            append_eval(r.dir, step, rec)
        append_eval(r.dir, r.steps, rec)  # a re-evaluated step (resume): same record twice


def test_report_pairs_by_seed_and_reads_d0_at_equal_flops(tmp_path):
    base = _base(tmp_path)
    vs = grid.variants([0, 1, 2], grid.parse_kinds("sequential,parallel@2", [0, 1, 2]), ["constant:0.3"])
    runs = grid.plan_runs(base, vs, [0, 1], 8, tmp_path / "out")
    _fake_evals(runs)
    times = {"variants": {v.name: {"seconds": 1.0 + v.depth, "ratio": 1.0 + 0.25 * v.depth} for v in vs}}
    res = report.collect(base, runs, vs, [0, 1], 8, times)
    eq = grid.equal_flops_steps(base, vs, 8)
    r2p = res["variants"]["d2-par-constant_0.3"]
    assert r2p["loss_main"]["values"] == pytest.approx([3.0 - 0.25 - 0.008, 3.0 - 0.25 - 0.008 + 0.01])
    assert r2p["delta_loss_main"]["mean"] == pytest.approx(-0.25) and r2p["delta_loss_main"]["std"] == pytest.approx(0)
    n = eq["d2-par-constant_0.3"]
    assert r2p["equal_flops"]["d0_steps"] == n
    assert r2p["equal_flops"]["delta_loss_main"]["mean"] == pytest.approx(-0.25 - 0.001 * (8 - n))
    assert r2p["agreement"][1]["mean"] == 0.25 and r2p["expected_tokens_per_round"]["mean"] == pytest.approx(1.625)
    assert r2p["step_time_ratio"] == 1.5 and r2p["flops_ratio"] > 1
    assert res["variants"]["d0"]["delta_loss_main"]["mean"] == 0
    assert [p["step"] for p in res["curves"]["0/d0"]["points"]][-1] == max(eq.values())
    assert res["tokens"] == 8 * base.train.batch_size * base.data.seq_len
    text = report.table(res)
    assert "d2-par-constant_0.3" in text and "-0.2500 ± 0.0000" in text and f"({n})" in text
    md = report.markdown(res).splitlines()  # docs/ablation.md's table: the same cells between pipes
    assert md[2].count("|") == len(report.HEAD) + 1 and md[3].startswith("| ---")
    assert [line.split(" | ")[0] for line in md[4:]] == [f"| {v.name}" for v in vs]
    summ = report.summary(res)
    assert [r["variant"] for r in summ["rows"]] == [v.name for v in vs[1:]]
    from bench.ablation.plots import make_plots

    paths = make_plots(res, tmp_path)
    assert [Path(p).name for p in paths] == ["loss_vs_tokens.png", "loss_vs_flops.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


@pytest.mark.slow
def test_report_states_the_task_metric_and_where_it_pays(tmp_path):
    from mtpjax.eval.evidence import task_lines

    base = _base(tmp_path)
    vs = grid.variants([0, 1, 2], {"sequential": [1, 2]}, ["constant:0.3"])
    runs = grid.plan_runs(base, vs, [0, 1], 8, tmp_path / "out")
    _fake_evals(runs, task=True)
    res = report.collect(base, runs, vs, [0, 1], 8)
    assert res["task_metric"] == "task/induction_accuracy"
    d1, d2 = res["variants"]["d1-seq-constant_0.3"]["task"], res["variants"]["d2-seq-constant_0.3"]["task"]
    assert d1["delta"]["values"] == pytest.approx([0.2, 0.5]) and not d1["pays"]  # 0.35 < 2 x 0.21
    assert d2["delta"]["values"] == pytest.approx([0.4, 0.45]) and d2["pays"]
    assert res["variants"]["d2-seq-constant_0.3"]["equal_flops"]["task"]["pays"]  # the metric is flat in steps
    assert "+0.425 ± 0.035 (pays)" in report.table(res) and "task/induction_accuracy" in report.markdown(res)
    res["summary"] = report.summary(res)
    (tmp_path / "induction").mkdir()
    (tmp_path / "induction" / "results.json").write_text(json.dumps(res))
    lines = task_lines({"induction": tmp_path / "induction" / "results.json", "bytes": tmp_path / "absent.json"})
    assert "best: D=2 sequential λ=constant:0.3 +0.425 ± 0.035 at equal tokens (pays)" in lines[1]
    assert lines[-1].endswith("in: induction: D=2 sequential λ=constant:0.3 at equal tokens; induction: D=2 "
                              "sequential λ=constant:0.3 at equal flops")
    from bench.ablation.plots import make_plots

    names = [Path(p).name for p in make_plots(res, tmp_path)]
    assert names == ["loss_vs_tokens.png", "loss_vs_flops.png", "task_vs_tokens.png", "task_vs_flops.png"]


def test_companion_a_spread_as_wide_as_the_difference_never_pays():
    """What `pays` guards: a mean difference within twice the seed spread (or with one seed) is no result."""
    s = lambda m, sd: {"mean": m, "std": sd}
    assert report.pays(s(0.3, 0.1), s(0.5, 0.1))
    assert not report.pays(s(0.3, 0.16), s(0.5, 0.1)) and not report.pays(s(0.3, 0.1), s(0.5, 0.16))
    assert not report.pays(s(0.3, None), s(0.5, None)) and not report.pays(s(-0.3, 0.01), s(0.5, 0.01))


def test_report_names_a_missing_eval(tmp_path):
    base = _base(tmp_path)
    vs = grid.variants([0, 1], {"sequential": [1]}, ["constant:0.3"])
    runs = grid.plan_runs(base, vs, [0], 8, tmp_path / "out")
    _fake_evals(runs[:1])
    with pytest.raises(report.ReportError, match="d1-seq-constant_0.3' has no eval at step 8; re-run the sweep"):
        report.collect(base, runs, vs, [0], 8)


def test_eval_log_keeps_the_last_record_of_a_step_and_skips_a_cut_line(tmp_path):
    append_eval(tmp_path, 4, {"loss/main": 2.0})
    append_eval(tmp_path, 2, {"loss/main": 3.0})
    append_eval(tmp_path, 4, {"loss/main": 1.5})
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write('{"step": 6, "loss/ma')  # killed mid-write
    assert read_evals(tmp_path) == [{"step": 2, "loss/main": 3.0}, {"step": 4, "loss/main": 1.5}]
    assert read_evals(tmp_path / "nothing") == []


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, message", [
    (["--depths", "1,2"], "--depths '1,2' must include 0"),
    (["--depths", "0,x"], "--depths '0,x' must be comma-separated integers"),
    (["--kinds", "diagonal"], "--kinds: unknown kind 'diagonal'"),
    (["--kinds", "parallel@3"], "--kinds 'parallel@3': depth 3 is not one of the MTP depths"),
    (["--lambda", "sometimes"], "config key 'loss.mtp_lambda' = 'sometimes' is invalid"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--seeds", "0"], "--seeds '0' must be a count >= 1"),
    (["--timing-rounds", "0"], "--timing-rounds 0 must be >= 1"),
    (["--config", "no/such.yaml"], "config file 'no/such.yaml' does not exist"),
    (["model.mtp_dpeth=2"], "did you mean 'model.mtp_depth'"),
    (["train.eval_batches=0"], "train.eval_batches=0: the ablation compares validation losses"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--report-only"], "--report-only: no seed has all its runs complete under"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["--smoke", "--config", CONFIG, "--out", str(out), *_data(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not out.exists()  # nothing written


def _old_run(tmp_path, base, steps, *over):
    """A run dir of D=0 as another sweep left it (only its config.yaml)."""
    old = replace(grid.variant_config(base, grid.Variant(0), 0, steps, tmp_path / "out" / "seed0" / "d0"), list(over))
    old_dir = Path(old.train.run_dir)
    old_dir.mkdir(parents=True)
    (old_dir / "config.yaml").write_text(old.to_yaml())
    return old_dir


@pytest.mark.parametrize("schedule, over, said", [
    ("constant", ["optim.lr=0.5"], "was trained with optim.lr=0.5, this sweep asks"),
    ("cosine", [], "was trained with train.steps=30, this sweep asks"),  # the run's length sets its lr
])
def test_an_out_dir_of_another_sweep_is_refused(tmp_path, capsys, schedule, over, said):
    sched = f"optim.schedule={schedule}"
    old_dir = _old_run(tmp_path, _base(tmp_path, sched), 30, *over)
    before = sorted(p.name for p in old_dir.iterdir())
    assert main(["--smoke", "--config", CONFIG, "--out", str(tmp_path / "out"), *_data(tmp_path), sched]) == 2
    err = capsys.readouterr().err
    assert said in err and "pass another --out" in err
    assert sorted(p.name for p in old_dir.iterdir()) == before


def test_under_a_constant_lr_a_run_of_another_length_is_continued(tmp_path):
    """Its first steps do not depend on its length (test_d0_read_at_step_n_...), so --steps may change."""
    base = _base(tmp_path)
    _old_run(tmp_path, base, 30)
    vs = grid.variants([0, 2], {"sequential": [2]}, ["constant:0.3"])
    sweep.check_same_sweep(grid.plan_runs(base, vs, [0], 8, tmp_path / "out"))


# ----------------------------------------------------------------------------- real sweeps (smoke size)


def _fingerprint(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()[:16]


@pytest.mark.slow
def test_variants_see_the_same_batches_and_start_from_the_same_shared_parameters(tmp_path, monkeypatch):
    """Recorded inside the train loop of a real sweep: every batch each variant trains and evaluates on."""
    seen: dict[str, dict] = {}
    real_programs = train_loop.make_programs

    def programs(cfg, *a, **kw):
        progs = real_programs(cfg, *a, **kw)
        rec = seen.setdefault(Path(cfg.train.run_dir).name, {"train": [], "eval": []})

        def init():
            state = progs.init()
            rec["init"] = _shared(state.params)
            return state

        def train_step(state, tok, seg):
            rec["train"].append((int(state.step), _fingerprint(tok), _fingerprint(seg)))
            return progs.train_step(state, tok, seg)

        def eval_step(state, tok, seg):
            rec["eval"].append(_fingerprint(tok))
            return progs.eval_step(state, tok, seg)

        import dataclasses

        return dataclasses.replace(progs, init=init, train_step=train_step, eval_step=eval_step)

    monkeypatch.setattr(train_loop, "make_programs", programs)
    out = tmp_path / "out"
    argv = ["--smoke", "--config", CONFIG, "--out", str(out), "--depths", "0,2", "--kinds", "sequential,parallel",
            "--timing-rounds", "1", *_data(tmp_path)]
    assert main(argv) == 0
    names = ["d0", "d2-seq-constant_0.3", "d2-par-constant_0.3"]
    assert sorted(seen) == sorted(names)
    steps = 8
    d0_train = seen["d0"]["train"]
    assert len(d0_train) > steps  # D=0 went on to the variants' FLOPs
    assert len({fp for _, fp, _ in d0_train[:steps]}) == steps  # eight different batches
    for n in names[1:]:
        assert seen[n]["train"] == d0_train[:steps], n  # same batches, same order, same step numbers
        assert seen[n]["init"] == seen["d0"]["init"], n
        assert seen[n]["eval"][:3] == seen["d0"]["eval"][:3] and len(set(seen[n]["eval"])) == 1  # one held-out batch
    # bits per byte logged by training: Σ CE / (ln 2 · bytes) over the one eval batch (tests/test_bpb.py has EOS)
    res = json.loads((out / "results.json").read_text())
    from mtpjax.eval.bpb import target_counts, token_byte_lengths
    from mtpjax.data import ByteTokenizer, make_iterator, prepare

    base = _base(tmp_path)
    val = next(make_iterator(prepare(base.data), split="val", seq_len=base.data.seq_len,
                             batch_size=base.train.batch_size, seed=0, shuffle=False))
    n_tgt, n_bytes = target_counts(val["tokens"], val["segment_ids"], token_byte_lengths(ByteTokenizer()))
    for n in names:
        last = next(e for e in read_evals(out / "seed0" / n) if e["step"] == steps)
        assert last["bits_per_byte"] == pytest.approx(last["loss/main"] * n_tgt / (np.log(2) * n_bytes), rel=1e-6)
        assert res["variants"][n]["bits_per_byte"]["mean"] == last["bits_per_byte"]


@pytest.mark.slow
def test_d0_read_at_step_n_of_the_longer_run_equals_a_run_of_n_steps(tmp_path):
    """Curve mode's premise, with its companion: under a decaying lr the longer run is not the shorter one."""
    from mtpjax.train.loop import train

    for schedule, equal in (("constant", True), ("cosine", False)):
        base = _base(tmp_path, f"optim.schedule={schedule}", "train.eval_every=4")
        long = grid.variant_config(base, grid.Variant(0), 0, 12, tmp_path / schedule / "long")
        short = grid.variant_config(base, grid.Variant(0), 0, 8, tmp_path / schedule / "short")
        train(long)
        train(short)
        at8 = lambda cfg: next(e["loss/main"] for e in read_evals(cfg.train.run_dir) if e["step"] == 8)
        assert (at8(long) == at8(short)) is equal, schedule


def _sweep(out: Path, data: list[str], *, kill_after: list[str] | None = None) -> subprocess.CompletedProcess | None:
    """The smoke sweep in a child process; with kill_after, SIGKILL it once those lines have appeared in order."""
    cmd = [sys.executable, "-m", "bench.ablation", "--smoke", "--config", CONFIG, "--out", str(out), "--depths", "0,2",
           "--timing-rounds", "1", *data]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if kill_after is None:
        return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    want = list(kill_after)
    for line in proc.stdout:  # event-driven: the kill follows the line it waits for
        if want and want[0] in line:
            want.pop(0)
            if not want:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert not want, f"never saw {want}"
    return None


def _without_timings(res: dict) -> dict:
    res = json.loads(json.dumps(res))
    for k in ("step_times", "command", "plots", "sweep_load", "load_at_report"):  # the load is not a result
        res.pop(k, None)
    for row in res["variants"].values():
        row.pop("step_seconds")
        row.pop("step_time_ratio")
    return res


@pytest.mark.slow
def test_smoke_sweep_killed_and_rerun_equals_an_uninterrupted_one(tmp_path):
    """Also: the variants trained afresh after a kill reproduce the uninterrupted sweep's losses exactly."""
    data = _data(tmp_path)
    whole = _sweep(tmp_path / "a", data)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "[3/3] seed 0 d2-par-constant_0.3" in whole.stdout and "ETA" in whole.stdout
    b = tmp_path / "b"
    _sweep(b, data, kill_after=["[2/3] seed 0 d2-seq"])  # between variants: d0 done, d2-seq not started
    _sweep(b, data, kill_after=["[1/3] seed 0 d0 (D=0): complete", "[3/3] seed 0 d2-par", "step 5: eval"])  # mid-run
    assert (b / "seed0" / "d2-par-constant_0.3" / "eval.jsonl").exists()
    assert not (b / "results.json").exists()
    rest = _sweep(b, data)
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    assert "[2/3] seed 0 d2-seq-constant_0.3 (D=2 sequential λ=constant:0.3): complete" in rest.stdout
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (tmp_path / "a", b))
    assert _without_timings(ra) == _without_timings(rb)
    assert ra["variants"]["d2-seq-constant_0.3"]["equal_flops"]["d0_steps"] > 8


# ---------------------------------------------------------------------------- curricula and targets (issue 24's re-run)


def test_grid_with_a_curriculum_and_a_tv_target(tmp_path):
    """The re-run's grid: D=0, D=1 and D=2 constant λ and under a forward curriculum, one tv variant at D=1."""
    base = _base(tmp_path)
    depths = [0, 1, 2]
    vs = grid.variants(depths, grid.parse_kinds("sequential", depths), ["constant:0.3"], ["forward:3"],
                       grid.parse_targets(["tv@1"], depths))
    assert [v.name for v in vs] == ["d0", "d1-seq-constant_0.3", "d1-seq-constant_0.3-forward_3",
                                    "d1-seq-constant_0.3-tv", "d2-seq-constant_0.3", "d2-seq-constant_0.3-forward_3"]
    runs = grid.plan_runs(base, vs, [0, 1], 8, tmp_path / "out")
    by = {(r.seed, r.dir.name): r.cfg for r in runs}
    assert str(by[1, "d2-seq-constant_0.3-forward_3"].loss.mtp_lambda_depths) == "forward:3"
    assert str(by[1, "d2-seq-constant_0.3"].loss.mtp_lambda_depths) == ""
    assert str(by[0, "d1-seq-constant_0.3-tv"].loss.mtp_target) == "tv"
    assert str(by[0, "d1-seq-constant_0.3-forward_3"].loss.mtp_target) == "data"
    assert "per depth forward:3" in vs[2].label and "target tv" in vs[3].label


def test_equal_flops_integrates_the_flops_spent_over_the_schedule(tmp_path):
    """A depth at λ 0 is computed (test_objectives compiles both), so a curriculum is charged like constant λ;
    an unrolled module adds its FLOPs; the tv target adds none. Companion: the unrolled variant costs more."""
    base = _base(tmp_path)
    cur = grid.Variant(2, "sequential", "constant:0.3", "forward:3")
    const = grid.Variant(2, "sequential", "constant:0.3")
    tv = grid.Variant(2, "sequential", "constant:0.3", target="tv")
    cfgs = {v: grid.variant_config(base, v, 0, 8, tmp_path) for v in (cur, const, tv)}
    spent = {v: grid.flops_spent(c, 8) for v, c in cfgs.items()}
    per_step = [grid.step_flops(cfgs[cur], s) for s in range(8)]
    assert spent[cur] == pytest.approx(sum(per_step)) and len(set(per_step)) == 1
    assert spent[cur] == spent[const] == spent[tv] > 0
    eq = grid.equal_flops_steps(base, [grid.Variant(0), cur, const], 100)
    assert eq[cur.name] == eq[const.name] > 100
    unrolled = replace(cfgs[const], ["loss.mtp_unroll=1"])
    assert grid.flops_spent(unrolled, 8) > spent[const]
    d0 = replace(base, ["model.mtp_depth=0"])
    assert eq[const.name] == round(100 * grid.flops_per_token(cfgs[const]) / grid.flops_per_token(d0))


@pytest.mark.parametrize("argv, message", [
    (["--target", "kl@1"], "config key 'loss.mtp_target' = 'kl' is invalid"),
    (["--target", "tv@3"], "--target 'tv@3': depth 3 is not one of the MTP depths"),
    (["--target", "tv@x"], "--target 'tv@x': depths after @ must be integers"),
    (["--curriculum", "sideways:2"], "config key 'loss.mtp_lambda_depths'"),
    (["--curriculum", "forward:4"], "switches at step 8, not before train.steps=8"),  # depth 2 on at step 8 of 8
])
def test_bad_curriculum_or_target_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["--smoke", "--config", CONFIG, "--out", str(out), *_data(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not out.exists()


def test_report_only_reports_the_complete_seeds_and_trains_nothing(tmp_path):
    """A sweep cut by time: seed 0 complete, seed 1 not; --report-only writes results.json for seed 0 alone."""
    base, out = _base(tmp_path), tmp_path / "out"
    vs = grid.variants([0, 1], {"sequential": [1]}, ["constant:0.3"])
    runs = grid.plan_runs(base, vs, [0, 1], 8, out)
    _fake_evals([r for r in runs if r.seed == 0])
    for r in runs:
        if r.seed == 0:
            (r.dir / "checkpoints" / str(r.steps)).mkdir(parents=True)
    argv = ["--smoke", "--config", CONFIG, "--out", str(out), *_data(tmp_path), "--depths", "0,1", "--kinds",
            "sequential", "--seeds", "2", "--report-only"]
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0] and res["step_times"] is None
    assert not (out / "seed1").exists()  # nothing trained


def test_report_command_prints_tables_and_refuses_a_missing_file(capsys):
    """`python -m bench.ablation.report FILE...` prints each results.json's table; --help is its usage (it opened
    '--help' as a file: a traceback), a missing file one line, exit 2."""
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[1] / "bench" / "ablation" / "results.json"
    assert report.main([str(recorded)]) == 0 and "| variant | loss/main |" in capsys.readouterr().out
    for argv, code, says in ((["--help"], 0, "usage:"), (["/nope.json"], 2, "/nope.json is not a file")):
        with pytest.raises(SystemExit) as e:
            report.main(argv)
        said = capsys.readouterr()
        assert e.value.code == code and says in said.out + said.err
