"""The README and docs stay true: every config key is in the configuration reference, and CI runs the README's
test command."""

import re
from pathlib import Path

from mtpjax.config import KEYS

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_is_documented():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in KEYS if f"`{k}`" not in reference]
    assert not missing, f"docs/configuration.md lacks config keys: {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]*pytest[^\n]*)\n```", readme)
    assert commands, "README has no test command"
    assert any(c in ci for c in commands)
