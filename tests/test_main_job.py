"""The README's main job end to end: train configs/tiny.yaml, then decode and evaluate it (slow: minutes)."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_readme_main_job_trains_and_speculates(quickstart_run, tmp_path):
    run, train_stderr = quickstart_run  # configs/tiny.yaml trained by the README's command
    # train.py's summary ends with the command to run next, for this run directory; it is run as printed below
    nxt = train_stderr.rstrip().splitlines()[-1]
    assert nxt == f"  next: python decode.py --run-dir {run} --prompt 'def fibonacci(n):' --stats"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    val = [e.value for e in acc.Scalars("eval/loss/main")]
    assert len(val) >= 3 and val[-1] < val[0] - 0.4, val  # clearly falling validation loss
    assert (run / "checkpoints").is_dir()

    python, *args = shlex.split(nxt.split("next: ", 1)[1])
    assert python == "python"
    gen = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr[-2000:]
    # greedy (the default) text of the tiny model repeats itself; test_quickstart judges the README's sampled decode
    assert len(gen.stdout.rstrip("\n")) >= 32 and "tokens/round=" in gen.stderr

    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "decode.py", "--run-dir", str(run), "--eval", "--json", str(out),
                         "--eval-prompts", "8", "--max-new-tokens", "128"], cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
    assert ev.returncode == 0, ev.stderr[-2000:]
    rep = json.loads(out.read_text())
    d, v = rep["decode"], rep["validation"]
    assert d["outputs_identical"]
    assert d["tokens_per_round"] > 1.5, d
    # Decode-time depth-1 acceptance equals (up to which positions start a round) the teacher-forced
    # agreement on the text it generated: the drafts see exactly the state training taught them.
    assert abs(d["acceptance_by_position"][0] - d["agreement_on_generated"][0]) < 0.03, d
    assert 0.0 < v["agreement/mtp_1"] <= 1.0
    # Free-running greedy text of the tiny model is repetitive, hence easier to draft than validation
    # text. Walking held-out validation text instead (teacher forcing, 32 texts x 128 positions), depth-1
    # acceptance is training's agreement/mtp_1 measured through the decoder: within a few points of it.
    assert abs(d["forced_acceptance_by_position"][0] - v["agreement/mtp_1"]) < 0.03, (d, v)
