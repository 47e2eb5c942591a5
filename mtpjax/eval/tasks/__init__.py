"""The harness's tasks: the shipped ones (YAML + JSONL here, made by generate.py) and lm-eval's, loaded offline.

A shipped task's YAML names its data file relative to this directory (`dataset_path: json`, `data_files`); the
`datasets` library would read it relative to the working directory, so `task_dir()` writes copies of the YAML
with absolute paths into a temporary directory, the one lm-eval's TaskManager is pointed at (`include_path`).
Datasets load with `HF_DATASETS_OFFLINE=1` unless the caller set it: a task whose data is on the hub and not
in the local cache fails at once as a TaskError instead of waiting on the network.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from mtpjax.errors import MtpjaxError

HERE = Path(__file__).resolve().parent
SHIPPED = ("mtpjax_nextline", "mtpjax_funcret", "mtpjax_heldout")
TAG = "mtpjax"  # every shipped task
OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class TaskError(MtpjaxError):
    """An unknown task, or one whose data cannot be read here (one line naming the fix)."""


def go_offline() -> None:
    """Datasets and the hub offline unless the user said otherwise (before `datasets` is imported)."""
    for name in OFFLINE:
        os.environ.setdefault(name, "1")


@functools.cache
def task_dir() -> Path:
    """A temporary directory of the shipped YAMLs with their data files made absolute (removed at exit)."""
    out = Path(tempfile.mkdtemp(prefix="mtpjax-tasks-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for src in sorted(HERE.glob("*.yaml")):
        spec = yaml.safe_load(src.read_text())
        files = spec["dataset_kwargs"]["data_files"]
        spec["dataset_kwargs"]["data_files"] = {k: str(HERE / v) for k, v in files.items()}
        (out / src.name).write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def only_shipped(names: list[str]) -> bool:
    """Whether every name is a shipped task or their tag (lm-eval's own index of ~15k YAMLs is then not read)."""
    return all(n in SHIPPED or n == TAG for n in names)


def task_manager(names: list[str]):
    """lm-eval's TaskManager over the shipped tasks, and its own unless only shipped ones are named (one of each per
    process: indexing lm-eval's takes seconds)."""
    return _manager(not only_shipped(names))


@functools.cache
def _manager(defaults: bool):
    go_offline()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()), include_defaults=defaults)


def parse_names(text: str) -> list[str]:
    """`a,b` -> ['a', 'b']; TaskError if empty."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TaskError("--tasks names no task; give task names separated by commas (e.g. mtpjax)")
    return names


def load(names: list[str], manager=None) -> dict:
    """lm-eval's loaded tasks ({'tasks': {name: Task}, ...}) of `names`; TaskError for an unknown task or data that
    cannot be read offline."""
    manager = manager or task_manager(names)
    try:
        return manager.load(names)
    except KeyError as e:
        raise TaskError(f"unknown task {first_arg(e)}; the shipped tasks are {TAG} ({', '.join(SHIPPED)}), "
                        "`lm-eval ls tasks` lists lm-eval's") from None
    except (ConnectionError, FileNotFoundError) as e:
        raise TaskError(f"a task's data cannot be read here ({first_arg(e)}); with the network, set "
                        "HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 to download it once") from None
    except (ValueError, yaml.YAMLError) as e:  # a task file that is not a task's YAML (binary, a bare string)
        raise TaskError(f"a task file among {', '.join(names)} is not lm-eval task YAML ({first_arg(e)}); fix it, "
                        "or name a known task") from None


def first_arg(e: BaseException) -> str:
    """An exception's message, its first line."""
    text = str(e.args[0]) if e.args else str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def evaluate(lm, names: list[str], *, limit: float | None = None, num_fewshot: int | None = None,
             manager=None) -> dict:
    """lm-eval's results of `lm` on the named tasks (checked first: TaskError for an unknown or unreadable one)."""
    import lm_eval

    manager = manager or task_manager(names)
    load(names, manager)
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                   log_samples=False, bootstrap_iters=0)


def scores(results: dict) -> dict[str, float]:
    """{'task/metric': value} of every numeric score in lm-eval's results (filters and stderr left out)."""
    out = {}
    for task, met in results["results"].items():
        for key, v in met.items():
            name, _, _ = key.partition(",")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not name.endswith("_stderr") and "," in key:
                out[f"{task}/{name}"] = float(v)
    return out
