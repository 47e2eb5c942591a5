"""Runs in a subprocess with 2 simulated CPU devices: a run trained on tensor=2, restored and evaluated there.

argv: <in.json> <out.json>; in.json names the tmp dir and corpus. Writes the training eval's record and
`decode.py --eval --json`'s report at the same step, decode.py's answers to bad meshes, what orbax was asked to
restore and the shards it returned (also for a restore that reads whole arrays first: "whole-first").
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_validation import OVERRIDES, STEP  # noqa: E402
from train_helpers import tiny_cfg  # noqa: E402

import mtpjax.train.checkpoint as checkpoint  # noqa: E402
from mtpjax.cli.decode import main  # noqa: E402
from mtpjax.config import MeshConfig  # noqa: E402
from mtpjax.decode import autodraft  # noqa: E402
from mtpjax.eval.log import read_evals  # noqa: E402
from mtpjax.nn.model import build_model  # noqa: E402
from mtpjax.parallel.sharding import make_mesh, placement, state_shardings  # noqa: E402
from mtpjax.train.loop import train  # noqa: E402


def decode_cli(argv: list[str]) -> dict:
    """decode.py's exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return {"rc": rc, "stderr": err.getvalue()}


def restore_report(load) -> dict:
    """Whether every parameter orbax was asked for had its training sharding as target, and per parameter whether
    its first addressable shard has the sharded shape and is smaller than the whole array."""
    asked = []
    real = checkpoint.SavedRun._restore

    def spy(self, step, what="", **items):
        asked.extend(items.values())
        return real(self, step, what, **items)

    checkpoint.SavedRun._restore = spy
    try:
        cfg, model = load()
    finally:
        checkpoint.SavedRun._restore = real
    mesh = model.placement.mesh
    want = nnx.to_pure_dict(state_shardings(nnx.state(model), mesh))
    items = [a.item for a in asked if isinstance(a, checkpoint.ocp.args.StandardRestore)]
    targeted = bool(items) and all(
        jax.tree.leaves(jax.tree.map(lambda t, s: getattr(t, "sharding", None) == s, items[-1], want)))
    shards = {}
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]:
        shard = x.addressable_shards[0].data.shape
        shards[jax.tree_util.keystr(path)] = [shard == x.sharding.shard_shape(x.shape), shard != x.shape]
    return {"targeted": targeted, "shards": shards}


def whole_first(run, step, mesh):
    """A restore that reads every parameter whole onto the host, then places it: what the restore must not do."""
    with checkpoint.SavedRun(run) as saved:
        cfg = saved.config(step)
        model = build_model(cfg, placement=placement(mesh))
        params = saved.params(step, cfg)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, jax.tree.map(jax.device_put, state, state_shardings(state, mesh)))
    return cfg, model


def main_worker(inp: dict) -> dict:
    assert jax.device_count() == 2
    tmp, corpus = Path(inp["tmp"]), Path(inp["corpus"])
    cfg = tiny_cfg(tmp, *OVERRIDES, "mesh.tensor=2", corpus=corpus)
    train(cfg)
    run = tmp / "run"
    out = {"run": str(run), "train_eval": [e for e in read_evals(run) if e["step"] == STEP][0]}
    report = tmp / "eval.json"
    out["eval"] = decode_cli(["--run-dir", str(run), "--eval", "--eval-prompts", "1", "--prompt-len", "8",
                              "--max-new-tokens", "8", "--json", str(report)])
    out["report"] = json.loads(report.read_text()) if report.exists() else None
    mesh = make_mesh(MeshConfig(tensor=2))
    out["restore"] = restore_report(lambda: checkpoint.SavedRun(run).model(STEP, mesh))
    out["whole_first"] = restore_report(lambda: whole_first(run, STEP, mesh))
    prompt = ["--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "2"]
    tags = []

    class Recorded(autodraft.SavedCalibrations):  # the key a calibration would be saved under
        def __init__(self, path, tag, refresh=False):
            tags.append(tag)
            super().__init__(path, tag, refresh)

    real, autodraft.SavedCalibrations = autodraft.SavedCalibrations, Recorded
    try:
        out["generate"] = decode_cli(prompt + ["--num-draft", "1", "--calibration-file", str(tmp / "cal.json")])
    finally:
        autodraft.SavedCalibrations = real
    out["calibration_tags"] = tags
    out["bad"] = {name: decode_cli(prompt + over) for name, over in {
        "product": ["mesh.tensor=1"], "dense-expert": ["mesh.tensor=1", "mesh.expert=2"],
        "not-mesh": ["train.steps=3"]}.items()}
    return out


if __name__ == "__main__":
    result = main_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result, default=str))
