"""The README's quickstart line, read as argv lists: what the quickstart tests run (train, then decode)."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands(readme: str | None = None) -> list[list[str]]:
    """The `&&`-joined commands of the quickstart's line that runs decode.py (pip install, train.py, decode.py)."""
    readme = (ROOT / "README.md").read_text() if readme is None else readme
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    line = next(ln for block in blocks for ln in block.splitlines() if "decode.py" in ln)
    return [shlex.split(part) for part in line.split("&&")]


def command(name: str, readme: str | None = None) -> list[str]:
    """The quickstart's `python <name> ...` command, as argv."""
    return next(c for c in quickstart_commands(readme) if c[:2] == ["python", name])


def with_run_dir(argv: list[str], run: Path) -> list[str]:
    """decode.py's argv with `--run-dir` pointed at `run`."""
    i = argv.index("--run-dir")
    return argv[: i + 1] + [str(run)] + argv[i + 2:]


def continuation(stdout: str, prompt: str) -> str:
    """What the decode generated: decode.py echoes the prompt, then the continuation."""
    at = stdout.find(prompt)
    assert at >= 0, f"the prompt {prompt!r} is not echoed in {stdout[:200]!r}"
    return stdout[at + len(prompt):]
