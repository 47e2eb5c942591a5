"""Multi-process start-up on JAX's own runtime (docs/design.md §3): `initialize()` before any other JAX use.

Where the processes come from (first match wins; `MTPJAX_CLUSTER=off` forces one process):
- explicit: `MTPJAX_COORDINATOR=host:port`, `MTPJAX_NUM_PROCESSES=N`, `MTPJAX_PROCESS_ID=i` (launch/local.sh,
  launch/jobset.yaml, any launcher that can number its processes);
- SLURM (`srun`, more than one task): coordinator, count and id from SLURM's variables via JAX's own
  SlurmCluster; one process per GPU when a node runs several tasks, else one per node with all its GPUs;
- TPU pod slice (`MTPJAX_CLUSTER=tpu`, set by launch/tpu_vm.sh, or several `TPU_WORKER_HOSTNAMES`):
  JAX's own TPU detection; any other JAX cluster name (`k8s`, `mpi4py`, ...) in `MTPJAX_CLUSTER` is passed on.
`MTPJAX_LOCAL_DEVICES=n` gives each process n CPU devices; `MTPJAX_INIT_TIMEOUT` (seconds, default 300)
bounds the rendezvous: a coordinator that cannot be reached, a missing process or processes that disagree
on the process count end the process with one line on stderr and exit status 2 instead of a hang.
Cross-process collectives on CPU use gloo.

A lost process (kill -9, out of memory, a failed host): every process heartbeats through the coordinator's
key-value store; when a peer's heartbeat has not moved for `MTPJAX_HEARTBEAT_TIMEOUT` seconds (default 30),
every survivor prints one line naming it and exits with status 75 (re-launch to resume) without committing a
checkpoint (orbax commits a save only after every process wrote its part). JAX's own coordination-service
heartbeat is set 30 s later, as a backstop. When the lost process is process 0, the coordinator itself is gone
and JAX's client ends the survivors at once (its own log, exit status 134); the launchers name the lost rank.

JAX internals used here, with no public equivalent (tests/test_distributed.py pins both): `jax._src.clusters.
SlurmCluster` (SLURM's coordinator, process count and ids as JAX itself reads them) and the key-value client
of `jax._src.distributed.global_state` (processes compare their counts before any collective could hang).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass

import jax

from mtpjax.errors import MtpjaxError, first_line

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "MTPJAX_COORDINATOR", "MTPJAX_NUM_PROCESSES", "MTPJAX_PROCESS_ID"
LOCAL_DEVICES, INIT_TIMEOUT, CLUSTER = "MTPJAX_LOCAL_DEVICES", "MTPJAX_INIT_TIMEOUT", "MTPJAX_CLUSTER"
HEARTBEAT = "MTPJAX_HEARTBEAT_TIMEOUT"
DEFAULT_TIMEOUT, DEFAULT_HEARTBEAT = 300, 30
LOST_EXIT_STATUS = 75  # EX_TEMPFAIL: nothing is wrong with the input; re-launch to resume


class DistributedError(MtpjaxError, RuntimeError):
    """A bad multi-process launch; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Launch:
    """How this process joins the run; None fields are left to JAX's cluster auto-detection."""

    method: str  # "env", "slurm", or a JAX cluster name ("tpu", "k8s", ...)
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    timeout: int


# ----------------------------------------------------------------------------- reading the environment


def _int_env(name: str, low: int, env=None) -> int | None:
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise DistributedError(f"{name}={raw!r} is not an integer >= {low}; set {name} to one")
    return value


def timeout_s() -> int:
    """Seconds allowed for the rendezvous (MTPJAX_INIT_TIMEOUT, default 300)."""
    t = _int_env(INIT_TIMEOUT, 1)
    return DEFAULT_TIMEOUT if t is None else t


def heartbeat_s() -> int:
    """Seconds without a peer's heartbeat before it counts as lost (MTPJAX_HEARTBEAT_TIMEOUT, default 30)."""
    t = _int_env(HEARTBEAT, 2)
    return DEFAULT_HEARTBEAT if t is None else t


def local_cpu_devices() -> int | None:
    """MTPJAX_LOCAL_DEVICES: CPU devices per process (None: JAX's default)."""
    return _int_env(LOCAL_DEVICES, 1)


def _explicit(timeout: int) -> Launch | None:
    n = _int_env(NUM_PROCESSES, 1)
    if n is None:
        for name in (COORDINATOR, PROCESS_ID):
            if os.environ.get(name):
                raise DistributedError(f"{name} is set but {NUM_PROCESSES} is not; set {NUM_PROCESSES} too")
        return None
    pid = _int_env(PROCESS_ID, 0)
    coord = os.environ.get(COORDINATOR, "").strip()
    if n == 1:
        return None
    if pid is None or not coord:
        missing = " and ".join(k for k, v in ((COORDINATOR, coord), (PROCESS_ID, pid)) if v in (None, ""))
        raise DistributedError(f"{NUM_PROCESSES}={n} needs {missing}; set {COORDINATOR}=host:port and "
                               f"{PROCESS_ID}=0..{n - 1} in every process")
    if pid >= n:
        raise DistributedError(f"{PROCESS_ID}={pid} is not below {NUM_PROCESSES}={n}; number the processes "
                               f"0..{n - 1}")
    if not re.fullmatch(r"\[?[^\s\[\]]+\]?:\d+", coord):
        raise DistributedError(f"{COORDINATOR}={coord!r} is not host:port; e.g. {COORDINATOR}=10.0.0.1:12355")
    return Launch("env", coord, n, pid, None, timeout)


def _tasks_on_this_node() -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3": one count per node, in node order
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE") or "1"
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int_env("SLURM_NODEID", 0) or 0
    return counts[node] if node < len(counts) else (counts[0] if counts else 1)


def _slurm(timeout: int) -> Launch | None:
    from jax._src.clusters import SlurmCluster

    if not SlurmCluster.is_env_present() or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return None
    coord = SlurmCluster.get_coordinator_address(timeout, os.environ.get("JAX_COORDINATOR_PORT"))
    # JAX would pin each task to GPU SLURM_LOCALID; that is right only when a node runs several tasks.
    local = None
    if _tasks_on_this_node() > 1 and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        local = (SlurmCluster.get_local_process_id(),)
    return Launch("slurm", coord, SlurmCluster.get_process_count(), SlurmCluster.get_process_id(), local, timeout)


def detect() -> Launch | None:
    """How this process joins a multi-process run, from the environment; None when it runs alone."""
    timeout = timeout_s()
    local_cpu_devices()  # validate early
    heartbeat_s()
    cluster = os.environ.get(CLUSTER, "auto").strip().lower() or "auto"
    if cluster == "off":
        return None
    if cluster != "auto":
        return Launch(cluster, None, None, None, None, timeout)
    launch = _explicit(timeout) or _slurm(timeout)
    if launch is None and len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        launch = Launch("tpu", None, None, None, None, timeout)
    return launch


# ----------------------------------------------------------------------------- joining


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False


def _stuck_message(launch: Launch) -> str:
    who = f"process {launch.process_id} of {launch.num_processes}" if launch.num_processes else "this process"
    t = f"within {launch.timeout} s ({INIT_TIMEOUT})"
    if launch.coordinator is None:
        return f"{who} could not join the {launch.method} cluster {t}; check that every worker runs the same command"
    if launch.process_id != 0 and not _reachable(launch.coordinator):
        return (f"{who} cannot reach the coordinator {launch.coordinator} {t}; start process 0 there and check "
                f"{COORDINATOR} (host and a free, open port)")
    return (f"{who}: not all {launch.num_processes} processes joined the coordinator {launch.coordinator} {t}; "
            f"start every process with the same {NUM_PROCESSES} and its own {PROCESS_ID}")


class _Watchdog:
    """Ends the process with one line if the rendezvous outlasts its timeout (JAX would block, then abort)."""

    def __init__(self, launch: Launch):
        self.launch, self.done = launch, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mtpjax-rendezvous-watchdog")

    def _run(self):
        if not self.done.wait(self.launch.timeout):
            print(f"error: {_stuck_message(self.launch)}", file=sys.stderr, flush=True)
            os._exit(DistributedError.exit_status)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()


def _check_agreement(launch: Launch) -> None:
    """Every process must have been started with the coordinator's process count (JAX does not check).

    Compared through the coordinator's key-value store: a collective would hang on a process that waits
    for more peers than exist.
    """
    from jax._src import distributed as jd

    client, me, n = jd.global_state.client, jd.global_state.process_id, jd.global_state.num_processes
    client.key_value_set(f"mtpjax/num_processes/{me}", str(n))
    peers = [0] if me else range(1, n)
    for p in peers:
        theirs = int(client.blocking_key_value_get(f"mtpjax/num_processes/{p}", launch.timeout * 1000))
        if theirs != n:
            raise DistributedError(f"process {me} was started with {NUM_PROCESSES}={n} but process {p} with "
                                   f"{theirs}; start every process with the same {NUM_PROCESSES}")
    client.wait_at_barrier("mtpjax/joined", launch.timeout * 1000)


def configure_local_devices() -> None:
    """Apply MTPJAX_LOCAL_DEVICES (CPU devices per process); must precede any JAX computation."""
    n = local_cpu_devices()
    if n is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)  # JAX refuses a change once its backends exist
    except RuntimeError:
        if jax.local_device_count() != n:
            raise DistributedError(f"{LOCAL_DEVICES}={n} was read after JAX started with "
                                   f"{jax.local_device_count()} devices; call mtpjax.parallel.distributed.initialize() "
                                   "before any other JAX use") from None


def initialize() -> Launch | None:
    """Join the multi-process run described by the environment (no-op alone); DistributedError if misconfigured."""
    configure_local_devices()
    launch = detect()
    if launch is None or jax.distributed.is_initialized():
        return launch
    kw = dict(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
              process_id=launch.process_id, local_device_ids=launch.local_device_ids,
              # JAX's own deadlines lie past ours so that our watchdogs, not an abort, report a stuck start or a
              # lost process
              initialization_timeout=2 * launch.timeout + 30, heartbeat_timeout_seconds=heartbeat_s() + 30)
    if launch.method == "env" or launch.method == "slurm":
        kw["cluster_detection_method"] = "deactivate"
    elif launch.method != "tpu":
        kw["cluster_detection_method"] = launch.method
    with _Watchdog(launch):
        try:
            jax.distributed.initialize(**kw)
        except (RuntimeError, ValueError) as e:  # JAX raises several types; the user needs one line
            if _backends_started(e):
                raise DistributedError("JAX was used before mtpjax.parallel.distributed.initialize(); call it first, "
                                       "before any other JAX use") from None
            raise DistributedError(f"jax.distributed.initialize failed ({first_line(e)}); check "
                                   f"the {launch.method} launch settings") from None
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # backends start after this
        _check_agreement(launch)
    _PeerWatch.start(heartbeat_s())
    return launch


def _backends_started(e: Exception) -> bool:
    """Whether JAX refused because its backends already exist (its documented RuntimeError of initialize)."""
    return isinstance(e, RuntimeError) and "must be called before any JAX" in str(e)


def is_primary() -> bool:
    """True on process 0, the one that writes logs, TensorBoard and run files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- a lost process


class _PeerWatch:
    """Heartbeats this process through the coordinator's key-value store and ends it with one line when a peer's
    heartbeat stops for `timeout` seconds (a peer that called `finished()` is no longer watched)."""

    current: _PeerWatch | None = None

    def __init__(self, timeout: int):
        from jax._src import distributed as jd

        self.client, self.me, self.n = jd.global_state.client, jd.global_state.process_id, jd.global_state.num_processes
        self.timeout, self.interval = timeout, max(0.2, timeout / 10)
        self.thread = threading.Thread(target=self._run, daemon=True, name="mtpjax-peer-watch")
        self.beats: dict[int, float] = {}  # when each peer's heartbeat last moved (time.monotonic)
        self.done: set[str] = set()

    @classmethod
    def start(cls, timeout: int) -> None:
        cls.current = cls(timeout)
        cls.current.thread.start()

    def _run(self) -> None:
        beat, seen, reached = 0, {}, time.monotonic()
        while True:
            now = time.monotonic()
            try:
                self.client.key_value_set(f"mtpjax/alive/{self.me}", str(beat), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get("mtpjax/alive/"))
                self.done = {k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get("mtpjax/done/")}
                reached, beat = now, beat + 1
            except Exception:  # the coordinator does not answer (JAX's client usually ends the process first)
                if now - reached > self.timeout:
                    self._lost(0, "the coordinator")
                values = None
            for p in range(self.n) if values is not None else ():
                v = values.get(f"mtpjax/alive/{p}")
                if p == self.me or str(p) in self.done:
                    continue
                if p not in seen or seen[p][0] != v:
                    seen[p] = (v, now)
                    self.beats[p] = now
                elif now - seen[p][1] > self.timeout:
                    self._lost(p, "")
            time.sleep(self.interval)

    def _lost(self, p: int, what: str) -> None:
        who = f"process {p} of {self.n}" + (f" ({what})" if what else "")
        print(f"error: {who} was lost (no heartbeat for {self.timeout} s: killed, out of memory or its host failed); "
              f"process {self.me} stops without committing a checkpoint; re-launch the run to resume from its last "
              "complete checkpoint", file=sys.stderr, flush=True)
        os._exit(LOST_EXIT_STATUS)


def finished() -> None:
    """Tell the other processes that this one ends normally (its heartbeat stopping is then no loss)."""
    w = _PeerWatch.current
    if w is not None:
        w.client.key_value_set(f"mtpjax/done/{w.me}", "1", allow_overwrite=True)


def await_lost_peer() -> None:
    """After a failure in a multi-process run: wait until the peer watch has decided whether a process was lost (it
    then ends this process with its line); returns once every other process has shown a heartbeat since (the
    failure is another one, reported as usual), at once on one process."""
    w = _PeerWatch.current
    if w is None:
        return
    since, deadline = time.monotonic(), time.monotonic() + w.timeout + 3 * w.interval + 5
    while w.thread.is_alive() and time.monotonic() < deadline:
        peers = [p for p in range(w.n) if p != w.me and str(p) not in w.done]
        if all(w.beats.get(p, 0.0) > since + w.interval for p in peers):
            return
        time.sleep(w.interval / 4)
