"""The README's quickstart ends with recognisable Python: configs/tiny.yaml trained by the README's train command,
then the README's decode command, judged by tests/pythonish.py (slow: the shared `quickstart_run` trains ~10 min).

The sampling settings on the README's command (temperature 0.7, top-k 40, 512 new tokens, one MTP draft) were
chosen on seeds 100-105; on seeds 0-9 x the four prompts below, 21 of 40 continuations passed the checker.
"""

import importlib.util
import itertools
import subprocess
import sys

import pytest
from pythonish import check_pythonish
from readme_quickstart import ROOT, command, continuation, with_run_dir

PROMPTS = ["def fibonacci(n):", "import os", "class Foo:", "def main():"]


def test_readme_quickstart_is_parsed():
    train, decode = command("train.py"), command("decode.py")
    assert train[2:4] == ["--config", "configs/tiny.yaml"]
    for flag in ("--prompt", "--stats", "--run-dir", "--temperature", "--num-draft"):
        assert flag in decode, flag
    assert float(decode[decode.index("--temperature") + 1]) > 0  # greedy text of a small model repeats itself
    assert int(decode[decode.index("--num-draft") + 1]) >= 1  # speculative: its statistics are shown
    assert with_run_dir(["decode.py", "--run-dir", "runs/tiny", "--stats"], ROOT) == \
        ["decode.py", "--run-dir", str(ROOT), "--stats"]
    assert continuation("def f():\n    return 1\n", "def f():") == "\n    return 1\n"
    with pytest.raises(AssertionError, match="not echoed"):
        continuation("    return 1\n", "def f():")


def _readme_decode(run, prompt=None, seed=None) -> list[str]:
    """The README's decode argv (without `python decode.py`) on `run`, with another prompt or seed if given."""
    argv = with_run_dir(command("decode.py"), run)[2:]
    if prompt is not None:
        argv[argv.index("--prompt") + 1] = prompt
    return argv + ([] if seed is None else ["--seed", str(seed)])


@pytest.mark.slow
def test_readme_quickstart_decode_prints_python_lines(quickstart_run):
    """The README's decode command as written: the prompt, a continuation, then speculative decoding's statistics.

    What the text reads as is judged across prompts and seeds below, not on this one sample: this asked 5 statement
    lines, 3 keyword lines and 2 keywords of it, which 31, 30 and 25 of 44 samples (4 prompts x the default seed
    and seeds 0-9) met on three trainings of this config that differ only in rounding (main's loss; it scaled by
    1 + 2^-22; the loss's gradient written out) - the last failed it here (8, 2, 1). The README says so: the same
    seed gives other text where kernels round differently."""
    run, _ = quickstart_run
    argv = _readme_decode(run)
    prompt = argv[argv.index("--prompt") + 1]
    res = subprocess.run([sys.executable, "decode.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(prompt)
    assert continuation(res.stdout, prompt).strip()
    assert "acceptance=" in res.stderr and "draft=1" in res.stderr, res.stderr  # speculative decoding's stats


@pytest.mark.slow
def test_readme_sampling_reads_as_python_across_prompts_and_seeds(quickstart_run, capsys):
    """Not one lucky sample: the README's flags on 4 prompts x 10 seeds; the checker's full verdict passes for at
    least a quarter of them (21 of 40 when measured; 23, 15 and 16 on three trainings that differ only in rounding,
    above; the byte-level model this config replaced passed 0 of 8)."""
    run, _ = quickstart_run
    spec = importlib.util.spec_from_file_location("decode_entry", ROOT / "decode.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    verdicts = {}
    for prompt, seed in itertools.product(PROMPTS, range(10)):
        assert entry.main(_readme_decode(run, prompt, seed)) == 0
        out = capsys.readouterr().out
        verdicts[prompt, seed] = check_pythonish(continuation(out, prompt), prompt).ok
    passed = sum(verdicts.values())
    assert passed >= 10, verdicts
