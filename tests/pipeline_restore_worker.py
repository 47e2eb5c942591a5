"""Runs in a subprocess with 2 simulated CPU devices: a run trained with pipeline stages (mesh.stage=2), and a run
trained without them (on one device, by the test) resumed here with stages, and a run of 3 blocks staged 2 + 1,
then evaluated by `decode.py --eval` on its own staged mesh.

argv: <in.json> <out.json>; in.json names the tmp dir, the corpus and the unstaged run's directory. Writes each
run's per-step losses and evals; the staged run's directory is left for the test to restore on one device.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_restore import EVAL, STAGED, UNEVEN, resumable_copy, run_cfg  # noqa: E402

from mtpjax.cli.decode import main as decode_main  # noqa: E402
from mtpjax.eval.log import read_evals  # noqa: E402
from mtpjax.train.loop import train  # noqa: E402


def main_worker(inp: dict) -> dict:
    assert jax.device_count() == 2
    tmp, corpus = Path(inp["tmp"]), Path(inp["corpus"])
    staged = train(run_cfg(tmp, corpus, "staged", *STAGED, *EVAL))
    # the unstaged run, cut back to its middle checkpoint, continued with stages
    cont = resumable_copy(Path(inp["unstaged"]), tmp / "unstaged-on-stages")
    resumed = train(run_cfg(tmp, corpus, cont.name, *STAGED))
    uneven = train(run_cfg(tmp, corpus, "uneven", *STAGED, *UNEVEN, "mesh.stage_layers=[2,1]"))
    return {"staged": staged["history"], "staged_evals": read_evals(tmp / "staged"),
            "unstaged_resumed_on_stages": resumed["history"], "uneven": uneven["history"],
            "uneven_eval_on_its_mesh": eval_on_mesh(tmp / "uneven", tmp / "uneven-eval.json")}


def eval_on_mesh(run: Path, report: Path) -> dict:
    """decode.py --eval of a run on its own mesh (both devices here): the report's validation, or the error."""
    try:
        rc = decode_main(["--run-dir", str(run), "--eval", "--eval-prompts", "1", "--prompt-len", "8",
                          "--max-new-tokens", "8", "--json", str(report)])
    except Exception as e:  # noqa: BLE001 - the test names what went wrong
        return {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
    return {"rc": rc, **({"validation": json.loads(report.read_text())["validation"]} if rc == 0 else {})}


if __name__ == "__main__":
    result = main_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result, default=str))
