"""Multi-process training: environment detection, rendezvous errors, launchers, and a real 2-process run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtpjax.parallel import distributed as dist
from mtpjax.parallel.distributed import DistributedError, Launch, detect

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import HANG, evaluated_at, free_port, sub_env, wait_for, write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
NOISE = ("[Gloo]",)  # gloo's C++ connection notices go to stderr; they are not ours


@pytest.fixture
def env(monkeypatch):
    """A clean launch environment: no MTPJAX_*, SLURM_*, TPU_* or JAX_* cluster variables."""
    for k in list(os.environ):
        if k.startswith(("MTPJAX_", "SLURM_", "TPU_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE")):
            monkeypatch.delenv(k)
    return monkeypatch


def our_lines(text: str) -> list[str]:
    return [ln for ln in text.strip().splitlines() if ln and not ln.startswith(NOISE)]


# ----------------------------------------------------------------------------- detection


def test_alone_is_a_noop(env):
    assert detect() is None
    env.setenv("MTPJAX_NUM_PROCESSES", "1")
    assert detect() is None


def test_explicit_variables(env):
    env.setenv("MTPJAX_COORDINATOR", "10.0.0.1:12355")
    env.setenv("MTPJAX_NUM_PROCESSES", "4")
    env.setenv("MTPJAX_PROCESS_ID", "3")
    assert detect() == Launch("env", "10.0.0.1:12355", 4, 3, None, 300)
    env.setenv("MTPJAX_INIT_TIMEOUT", "7")
    assert detect().timeout == 7
    env.setenv("MTPJAX_CLUSTER", "off")
    assert detect() is None


@pytest.mark.parametrize("variables, named", [
    ({"MTPJAX_NUM_PROCESSES": "two"}, "MTPJAX_NUM_PROCESSES"),
    ({"MTPJAX_NUM_PROCESSES": "0"}, "MTPJAX_NUM_PROCESSES"),
    ({"MTPJAX_NUM_PROCESSES": "2", "MTPJAX_PROCESS_ID": "0"}, "MTPJAX_COORDINATOR"),
    ({"MTPJAX_NUM_PROCESSES": "2", "MTPJAX_COORDINATOR": "h:1"}, "MTPJAX_PROCESS_ID"),
    ({"MTPJAX_NUM_PROCESSES": "2", "MTPJAX_COORDINATOR": "h:1", "MTPJAX_PROCESS_ID": "2"}, "MTPJAX_PROCESS_ID"),
    ({"MTPJAX_NUM_PROCESSES": "2", "MTPJAX_COORDINATOR": "h:1", "MTPJAX_PROCESS_ID": "-1"}, "MTPJAX_PROCESS_ID"),
    ({"MTPJAX_NUM_PROCESSES": "2", "MTPJAX_COORDINATOR": "host", "MTPJAX_PROCESS_ID": "0"}, "MTPJAX_COORDINATOR"),
    ({"MTPJAX_PROCESS_ID": "1"}, "MTPJAX_NUM_PROCESSES"),
    ({"MTPJAX_INIT_TIMEOUT": "0"}, "MTPJAX_INIT_TIMEOUT"),
    ({"MTPJAX_HEARTBEAT_TIMEOUT": "1"}, "MTPJAX_HEARTBEAT_TIMEOUT"),
    ({"MTPJAX_LOCAL_DEVICES": "x"}, "MTPJAX_LOCAL_DEVICES"),
])
def test_bad_variables_are_one_line_errors(env, variables, named):
    for k, v in variables.items():
        env.setenv(k, v)
    with pytest.raises(DistributedError) as e:
        detect()
    assert named in str(e.value) and "\n" not in str(e.value)


def slurm_env(env, tasks_per_node: str, ntasks: int, procid: int, localid: int):
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": ntasks,
                 "SLURM_PROCID": procid, "SLURM_LOCALID": localid, "SLURM_NODEID": procid // max(1, ntasks // 2),
                 "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}.items():
        env.setenv(k, str(v))


def test_slurm_one_process_per_gpu(env):
    slurm_env(env, "8(x2)", 16, 13, 5)
    port = 4242 % 2**12 + 65535 - 2**12 + 1  # JAX's SLURM rule: an ephemeral port derived from the job id
    assert detect() == Launch("slurm", f"gpu017:{port}", 16, 13, (5,), 300)
    env.setenv("JAX_COORDINATOR_PORT", "23456")
    assert detect().coordinator == "gpu017:23456"


def test_slurm_one_process_per_node_sees_all_its_gpus(env):
    slurm_env(env, "1(x2)", 2, 1, 0)
    assert detect() == Launch("slurm", detect().coordinator, 2, 1, None, 300)


def test_slurm_single_task_is_alone(env):
    slurm_env(env, "1", 1, 0, 0)
    assert detect() is None


def test_tpu_is_left_to_jax(env):
    env.setenv("MTPJAX_CLUSTER", "tpu")
    assert detect() == Launch("tpu", None, None, None, None, 300)
    env.delenv("MTPJAX_CLUSTER")
    env.setenv("TPU_WORKER_HOSTNAMES", "w-0,w-1,w-2,w-3")
    assert detect().method == "tpu"


def test_initialize_after_jax_use_is_refused(env):
    import jax

    jax.devices()
    env.setenv("MTPJAX_COORDINATOR", f"127.0.0.1:{free_port()}")
    env.setenv("MTPJAX_NUM_PROCESSES", "2")
    env.setenv("MTPJAX_PROCESS_ID", "0")
    with pytest.raises(DistributedError, match="before any other JAX use"):
        dist.initialize()
    env.setenv("MTPJAX_LOCAL_DEVICES", str(jax.local_device_count() + 1))
    with pytest.raises(DistributedError, match="MTPJAX_LOCAL_DEVICES"):
        dist.initialize()


def test_the_jax_internals_we_use_are_where_we_expect_them():
    """distributed.py uses two JAX internals with no public equivalent: this fails first when JAX moves them."""
    from jax._src import distributed as jd
    from jax._src.clusters import SlurmCluster
    from jax._src.lib import _jax

    for name in ("is_env_present", "get_coordinator_address", "get_process_count", "get_process_id",
                 "get_local_process_id"):
        assert callable(getattr(SlurmCluster, name)), name
    assert all(hasattr(jd.global_state, a) for a in ("client", "process_id", "num_processes"))
    for name in ("key_value_set", "blocking_key_value_get", "wait_at_barrier"):
        assert callable(getattr(_jax.DistributedRuntimeClient, name)), name


# ----------------------------------------------------------------------------- rendezvous (real processes)


def join(pid: int, n: int, port: int, timeout: int = 3, **kw) -> subprocess.Popen:
    env = sub_env(MTPJAX_COORDINATOR=f"127.0.0.1:{port}", MTPJAX_NUM_PROCESSES=n, MTPJAX_PROCESS_ID=pid,
                  MTPJAX_LOCAL_DEVICES=2, MTPJAX_INIT_TIMEOUT=timeout, PYTHONFAULTHANDLER=1, **kw)
    return subprocess.Popen([sys.executable, "-m", "mtpjax", "distributed"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str, list[str]]:
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a stuck process: its threads' stacks (PYTHONFAULTHANDLER) say where
        p.send_signal(signal.SIGABRT)
        pytest.fail(f"the process did not end within 120 s; where its threads were:\n{p.communicate()[1][-6000:]}")
    return p.returncode, out, our_lines(err)


def test_two_processes_join_and_all_reduce():
    port = free_port()
    procs = [join(i, 2, port, timeout=60) for i in range(2)]
    for i, p in enumerate(procs):
        rc, out, err = finish(p)
        assert rc == 0, err
        assert f"process {i} of 2 (env): 2 local / 4 global devices, all-reduce 3" in out


def test_unreachable_coordinator_is_one_line_within_the_timeout():
    rc, _, err = finish(join(1, 2, free_port(), timeout=2))
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: process 1 of 2 cannot reach the coordinator 127.0.0.1:")
    assert "within 2 s (MTPJAX_INIT_TIMEOUT)" in err[0]  # the timeout asked for, not the default 300 s


def test_missing_process_is_one_line_within_the_timeout():
    rc, _, err = finish(join(0, 2, free_port(), timeout=2))
    assert rc == 2 and len(err) == 1, err
    assert "not all 2 processes joined the coordinator" in err[0] and "MTPJAX_INIT_TIMEOUT" in err[0]


def test_mismatched_process_counts_stop_every_process():
    port = free_port()
    p0, p1 = join(0, 2, port, timeout=20), join(1, 3, port, timeout=20)
    for p, me, other, theirs in ((p0, 0, 1, 3), (p1, 1, 0, 2)):
        rc, _, err = finish(p)
        assert rc == 2 and len(err) == 1, err
        assert f"process {me} was started with MTPJAX_NUM_PROCESSES={2 if me == 0 else 3} but process {other} " \
               f"with {theirs}" in err[0]


def test_train_cli_reports_an_unreachable_coordinator(tmp_path):
    env = sub_env(MTPJAX_COORDINATOR=f"127.0.0.1:{free_port()}", MTPJAX_NUM_PROCESSES=2, MTPJAX_PROCESS_ID=1,
                  MTPJAX_INIT_TIMEOUT=2)
    p = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny.yaml"),
                        f"train.run_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=120)
    err = our_lines(p.stderr)
    assert p.returncode == 2 and len(err) == 1 and "cannot reach the coordinator" in err[0], p.stderr
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- launch/local.sh


def test_local_sh_usage():
    for args in ([], ["0"], ["two"]):
        p = subprocess.run(["bash", str(LAUNCH / "local.sh"), *args], capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.startswith("usage: launch/local.sh N"), p.stderr


def test_local_sh_names_a_python_that_is_not_there():
    """PYTHON naming no command: one line naming it, exit 2 (was bash's 'command not found', exit 1)."""
    p = subprocess.run(["bash", str(LAUNCH / "local.sh"), "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": "/no/such/python"})
    assert p.returncode == 2 and p.stderr == ("local.sh: PYTHON=/no/such/python is not a command here; set PYTHON to "
                                              "the interpreter that has mtpjax\n"), p.stderr


def test_local_sh_stops_the_others_when_one_fails(tmp_path):
    # Process 0 would run for a minute and notes when it is stopped; process 1 fails as soon as process 0 has
    # written its line (an event: failing before that, local.sh could stop process 0 before it wrote anything).
    # The wait is bounded: if process 0 never writes, process 1 fails after 30 s and so does the test.
    seen = tmp_path / "seen"
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/bash\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    f'echo "$MTPJAX_PROCESS_ID $MTPJAX_NUM_PROCESSES $MTPJAX_COORDINATOR $*" >> {seen}\n'
                    'if [ "$MTPJAX_PROCESS_ID" = 0 ]; then\n'
                    f'  trap \'kill $!; echo "0 stopped" >> {seen}; exit 143\' TERM\n'
                    '  sleep 60 & wait $!\n  exit 0\nfi\n'
                    f'for _ in $(seq 600); do [ "$(grep -c "^0 2 " {seen})" = 1 ] && break; sleep 0.05; done\n'
                    'exit 3\n')
    stub.chmod(0o755)
    p = subprocess.run(["bash", str(LAUNCH / "local.sh"), "2", "--config", "x.yaml", "a.b=1"],
                       env={**os.environ, "PYTHON": str(stub)}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "process 1 of 2 exited with status 3" in p.stderr
    lines = sorted(seen.read_text().splitlines())
    port = lines[0].split()[2]
    assert lines == sorted([f"{i} 2 {port} {LAUNCH}/../train.py --config x.yaml a.b=1" for i in range(2)]
                           + ["0 stopped"])  # both started, and process 0 was stopped
    assert port.startswith("127.0.0.1:")


def test_local_sh_names_a_lost_process(tmp_path):
    """Process 1 is killed (SIGKILL) once process 0 has started: local.sh names it as lost and stops process 0."""
    seen = tmp_path / "seen"
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/bash\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    f'echo "$MTPJAX_PROCESS_ID" >> {seen}\n'
                    'if [ "$MTPJAX_PROCESS_ID" = 0 ]; then\n'
                    f'  trap \'kill $!; echo "0 stopped" >> {seen}; exit 143\' TERM\n'
                    '  sleep 60 & wait $!\n  exit 0\nfi\n'
                    f'for _ in $(seq 600); do grep -q "^0$" {seen} && break; sleep 0.05; done\n'
                    'kill -9 $$\n')
    stub.chmod(0o755)
    p = subprocess.run(["bash", str(LAUNCH / "local.sh"), "2"], env={**os.environ, "PYTHON": str(stub)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 137, p.stderr
    assert "local.sh: process 1 of 2 was lost (killed by signal 9, SIGKILL); stopping the others" in p.stderr
    assert "0 stopped" in seen.read_text()


def test_slurm_sbatch_names_the_task_srun_lost(tmp_path):
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\necho "srun: error: node7: task 3: Killed" >&2\nexit 137\n')
    srun.chmod(0o755)
    env = {**sub_env(), "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO)}
    p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "c.yaml"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 137
    assert p.stderr.splitlines()[-1].startswith("slurm.sbatch: srun exited with status 137; process 3 was lost or "
                                                "failed first; re-submit"), p.stderr


SHRINK = ["model.d_model=32", "model.n_layers=2", "model.d_ff=64", "data.seq_len=64", "train.batch_size=8",
          "train.steps=4", "train.eval_every=4", "train.eval_batches=1", "train.log_every=1",
          "train.num_samples=1", "train.progress=false", "train.peak_flops=1e9", "checkpoint.every=2",
          "optim.lr=1e-2", "optim.warmup_steps=1", "mesh.data=2", "mesh.fsdp=2", "data.source=text",
          "data.tokenizer=byte", "model.vocab_size=256", "model.mtp_depth=2"]  # byte-level, two modules


def scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.mark.slow
def test_two_processes_match_one_and_resume_on_one(tmp_path):
    """local.sh 2 (2 x 2 CPU devices) and 1 process x 4 devices train on the same examples; resume on 1 continues."""
    run = tmp_path / "run"
    overrides = SHRINK + [f"data.paths={write_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'cache'}",
                          f"train.run_dir={run}"]
    env = sub_env(MTPJAX_LOCAL_DEVICES=2, MTPJAX_INIT_TIMEOUT=120)
    p = subprocess.run(["bash", str(LAUNCH / "local.sh"), "2", "--config", str(REPO / "configs/tiny.yaml"),
                        *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len([ln for ln in p.stderr.splitlines() if ln.startswith("step 4: eval")]) == 1  # process 0 only
    assert "not shared with process 0" not in p.stderr  # one host, one cache: process 1 waited and loaded it
    assert len([d for d in (tmp_path / "cache").iterdir() if not d.name.startswith(".")]) == 1
    assert len(list((run / "tensorboard").iterdir())) == 1
    two = {k: scalars(run / "tensorboard", f"loss/{k}") for k in ("main", "mtp_1", "mtp_2")}
    assert sorted(two["main"]) == [1, 2, 3, 4]  # every step; the first (compilation included) without throughput

    inp, out = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps({"config": str(REPO / "configs/tiny.yaml"), "overrides": overrides,
                               "resume_steps": 6}))
    w = subprocess.run([sys.executable, str(Path(__file__).parent / "distributed_worker.py"), str(inp), str(out)],
                       env=sub_env(), capture_output=True, text=True, timeout=900)
    assert w.returncode == 0, w.stderr[-3000:]
    res = json.loads(out.read_text())

    for k, by_step in two.items():  # the same config and mesh on one process logs the same losses
        assert sorted(int(s) for s in res["solo"][k]) == sorted(by_step)
        for step, v in by_step.items():
            assert v == pytest.approx(res["solo"][k][str(step)], rel=1e-5, abs=1e-6), (k, step)
    # had both processes fed the same rows, the run would have shown other losses
    assert abs(two["main"][2] - res["same_rows"][1]) > 1e-3
    # resumed on 1 process, the 2-process run continues the stream the 1-process run continues
    assert [s for s, _ in res["resumed_two"]] == [s for s, _ in res["resumed_solo"]] == [5, 6]
    for (s, a), (_, b) in zip(res["resumed_two"], res["resumed_solo"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), s


# ----------------------------------------------------------------------------- cluster launchers (cannot run here)


def stub(directory: Path, name: str) -> Path:
    """An executable that appends its argv (one shell-quoted line) and selected env to <name>.log."""
    path = directory / name
    path.write_text('#!/bin/bash\n{ printf "%q " "$@"; echo; env | grep -E "^(MTPJAX|JAX)_" | sort; } '
                    f'>> {directory}/{name}.log\n')
    path.chmod(0o755)
    return path


def test_slurm_sbatch_runs_train_py_under_srun(tmp_path):
    text = (LAUNCH / "slurm.sbatch").read_text()
    for directive in ("--nodes=", "--ntasks-per-node=", "--gpus-per-node=", "--time="):
        assert f"#SBATCH {directive}" in text
    stub(tmp_path, "srun")
    env = {**sub_env(), "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO)}
    p = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "configs/small.yaml", "train.run_dir=/s/r"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    argv, *envs = (tmp_path / "srun.log").read_text().splitlines()
    assert shlex.split(argv) == ["--kill-on-bad-exit=1", "python3", "train.py", "--config", "configs/small.yaml",
                                 "train.run_dir=/s/r"]
    assert "MTPJAX_INIT_TIMEOUT=300" in envs


def test_tpu_vm_runs_the_same_command_on_every_worker(tmp_path):
    stub(tmp_path, "gcloud")
    env = {**sub_env(), "PATH": f"{tmp_path}:{os.environ['PATH']}", "PROJECT": "proj", "MTPJAX_DIR": str(tmp_path),
           "PYTHON": str(stub(tmp_path, "python3"))}
    bad = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh"), "only-name"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
    args = ["--config", "configs/small.yaml", "train.run_dir=gs://b/my run"]
    p = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh"), "pod-32", "us-west4-a", *args], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    argv = shlex.split((tmp_path / "gcloud.log").read_text().splitlines()[0])
    assert argv[:6] == ["compute", "tpus", "tpu-vm", "ssh", "pod-32", "--zone=us-west4-a"]
    assert "--project=proj" in argv and "--worker=all" in argv
    remote = next(a for a in argv if a.startswith("--command="))[len("--command="):]
    # what each worker runs: replay it here with the stub interpreter
    subprocess.run(["bash", "-c", remote], env=env, check=True, timeout=30)
    ran, *envs = (tmp_path / "python3.log").read_text().splitlines()
    assert shlex.split(ran) == ["train.py", *args]
    assert "MTPJAX_CLUSTER=tpu" in envs and "MTPJAX_INIT_TIMEOUT=300" in envs


def test_jobset_numbers_its_pods_and_points_them_at_pod_0(env):
    js = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
    assert js["apiVersion"].startswith("jobset.x-k8s.io/") and js["kind"] == "JobSet"
    [rj] = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 1 and job["completionMode"] == "Indexed"
    [c] = job["template"]["spec"]["containers"]
    assert c["command"][:2] == ["python3", "train.py"]
    e = {v["name"]: v for v in c["env"]}
    n = int(e["MTPJAX_NUM_PROCESSES"]["value"])
    assert n == job["parallelism"] == job["completions"] > 1
    assert e["MTPJAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    host, port = e["MTPJAX_COORDINATOR"]["value"].rsplit(":", 1)
    name = js["metadata"]["name"]
    assert host == f"{name}-{rj['name']}-0-0.{name}"  # JobSet's DNS name of job 0, pod 0
    assert js["spec"].get("network", {}).get("enableDNSHostnames", True)
    assert {"containerPort": int(port)} in c["ports"]
    for i in range(n):  # what each pod's process makes of its environment
        for k in ("MTPJAX_COORDINATOR", "MTPJAX_NUM_PROCESSES", "MTPJAX_INIT_TIMEOUT"):
            env.setenv(k, e[k]["value"])
        env.setenv("MTPJAX_PROCESS_ID", str(i))
        assert detect() == Launch("env", f"{host}:{port}", n, i, None, int(e["MTPJAX_INIT_TIMEOUT"]["value"]))


def test_launchers_parse():
    for script in ("local.sh", "slurm.sbatch", "tpu_vm.sh"):
        subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)
        assert os.access(LAUNCH / script, os.X_OK)


@pytest.mark.slow
def test_interrupted_local_run_checkpoints_every_process_at_one_step(tmp_path):
    """SIGTERM to local.sh: both processes stop at one agreed step, checkpoint it together, exit 0."""
    run = tmp_path / "run"
    overrides = SHRINK + [f"data.paths={write_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'cache'}",
                          f"train.run_dir={run}", "train.steps=100000", "train.eval_every=2", "checkpoint.every=1000"]
    log = tmp_path / "local.log"  # a file: a pipe nobody reads while waiting could fill and stall the run
    p = subprocess.Popen(["bash", str(LAUNCH / "local.sh"), "2", "--config", str(REPO / "configs/tiny.yaml"),
                          *overrides], env=sub_env(MTPJAX_LOCAL_DEVICES=2, MTPJAX_INIT_TIMEOUT=120),
                         stdout=subprocess.DEVNULL, stderr=log.open("w"))
    # the eval at step 4 is logged: both processes are past step 3 (an eval is collective); past the first
    # step's, regular checkpoints would come at step 1000
    assert wait_for(lambda: evaluated_at(run, 4), p), log.read_text()[-3000:]
    p.send_signal(15)
    p.wait(timeout=HANG)
    err = log.read_text()
    assert p.returncode == 0, err[-3000:]
    done = [ln for ln in err.splitlines() if ln.startswith("preempted: checkpoint saved at step ")]
    assert len(done) == 1, err[-3000:]  # process 0 only
    step = int(done[0].rsplit(" ", 1)[1])
    saved = sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit())
    assert step > 3 and saved[-1] == step


def test_local_sh_does_not_tell_a_refused_command_to_run_again(tmp_path):
    """Exit status 2 is train.py refusing its input (a mesh for other devices, say): the same command is refused
    again, so local.sh does not tell the user to re-run it to resume."""
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/bash\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    'echo "error: mesh data*fsdp*tensor = 4*1*1 = 4 but 2 device(s) are available" >&2\nexit 2\n')
    stub.chmod(0o755)
    p = subprocess.run(["bash", str(LAUNCH / "local.sh"), "2"], env={**os.environ, "PYTHON": str(stub)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("local.sh:")]
    assert "exited with status 2" in line and "refused the command" in line and "run the same command" not in line
