"""The compiled train and eval steps keep their activations split by batch rows (issue 46): compiled for 8 simulated
devices (fsdp 4 x tensor 2, tests/collectives_worker.py), no collective moves an array larger than the largest
parameter (an FSDP weight gathered) or one device's share of the residual stream (a tensor-parallel partial sum).
An activation that lost its rows' split has every device hold and reduce the whole batch's: each companion removes
one constraint and finds such a collective."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ("none", "no_batch_rule", "no_swap_in_head")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{patch: the worker's JSON} of every PATCHES compile, two at a time."""
    tmp, slots, done = tmp_path_factory.mktemp("collectives"), threading.Semaphore(2), {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)

    def run(patch):
        with slots:
            p = subprocess.run([sys.executable, str(ROOT / "tests" / "collectives_worker.py"), patch,
                                str(tmp / f"{patch}.json")], env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        done[patch] = json.loads((tmp / f"{patch}.json").read_text())

    threads = [threading.Thread(target=run, args=(patch,)) for patch in PATCHES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(done) == set(PATCHES)
    return done


def bound(r: dict) -> int:
    """Bytes: the largest parameter, or one device's rows of the float32 residual stream [rows, T, D]."""
    return max(r["largest_parameter_bytes"], r["rows_per_device"] * r["T"] * r["D"] * 4)


def oversized(r: dict, program: str = "train_step") -> list[str]:
    return [f"{c['kind']} {c['shape']} {c['op_name']}" for c in r["programs"][program]
            if c["largest_array_bytes"] > bound(r)]  # XLA combines several collectives into one of a tuple


def test_the_bound_is_below_the_whole_batch_activations(runs):
    r = runs["none"]
    whole_batch = r["rows_per_device"] * 4 * r["T"] * r["D"] * 4  # fsdp 4: the batch on every device
    assert bound(r) < whole_batch


@pytest.mark.parametrize("program", ["train_step", "eval_step"])
def test_no_collective_moves_more_than_a_parameter_or_a_device_s_rows(runs, program):
    assert runs["none"]["programs"][program], "no collective at all: the mesh was not used"
    assert oversized(runs["none"], program) == []


def test_companion_without_the_batch_rule_the_whole_batch_is_reduced(runs):
    assert oversized(runs["no_batch_rule"])


def test_companion_a_head_flattening_depth_first_reduces_the_whole_batch_s_logits(runs):
    found = oversized(runs["no_swap_in_head"])
    assert found and all("head" in f for f in found), found
