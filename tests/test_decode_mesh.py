"""Decoding and evaluation on a mesh (issue 37): sharded speculative decoding equals one device token for token, caches
live where their producers do, `decode.py --eval` on 2 devices equals the training eval, restores land sharded.

The meshes run in subprocesses with emulated host devices (tests/mesh_decode_worker.py: 4, tests/mesh_cli_worker.py: 2),
each program compiled once; the pytest process stays single-device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import write_corpus

pytestmark = pytest.mark.slow


def _worker(name: str, tmp: Path, inp: dict) -> dict:
    (tmp / "in.json").write_text(json.dumps(inp))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    # the timeout allows a host loaded 15-fold (the loop worker takes 2.5 min of CPU)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / name), str(tmp / "in.json"),
                           str(tmp / "out.json")], env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    return _worker("mesh_decode_worker.py", tmp_path_factory.mktemp("mesh-loops"), {})


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh-cli")
    return _worker("mesh_cli_worker.py", tmp, {"tmp": str(tmp), "corpus": str(write_corpus(tmp))})


def test_sharded_greedy_equals_one_device_for_every_proposer(loops):
    for name, case in loops["cases"].items():
        assert case["mesh"] == case["one"], name
        assert all(len(t) == 16 for t in case["mesh"]), name
    for name in ("gqa-tensor2-mtp", "mla-moe-expert2-mtp", "mla-moe-tensor2-hybrid", "gqa-data2-tensor2-draft"):
        case = loops["cases"][name]
        assert 0 < case["accepted"] < case["reached"], name  # drafts accepted and rejected: rollbacks exercised


def test_companion_a_verification_reading_the_other_shards_rows_differs(loops):
    assert loops["other-rows"] != loops["cases"]["gqa-data2-tree"]["one"]


def test_caches_are_sharded_like_their_producers(loops):
    c = loops["cases"]
    # GQA on tensor=2: kv heads split, as wk/wv split theirs (module caches too)
    for field in ("trunk.k_BKSH", "trunk.v_BKSH", "module.k_BKSH"):
        lay = c["gqa-tensor2-mtp"]["layouts"][field]
        assert lay["spec"] == [None, "tensor", None, None], field
        assert lay["shard"][1] == lay["global"][1] // 2
    # data=2 (and expert=2, data-parallel outside the experts): rows split, every cache and the committed tokens
    for name in ("gqa-data2-tree", "mla-moe-expert2-mtp", "mla-moe-data2-ngram"):
        lay = c[name]["layouts"]
        for field in ("trunk." + ("k_BKSH" if name.startswith("gqa") else "c_BSZ"), "seq_BS"):
            assert lay[field]["shard"][0] == lay[field]["global"][0] // 2, (name, field)
            assert lay[field]["shard"][1:] == lay[field]["global"][1:], (name, field)
    # MLA on tensor=2: the latent cache has no head axis and is replicated over tensor
    for field in ("trunk.c_BSZ", "trunk.kr_BSH"):
        lay = c["mla-moe-tensor2-hybrid"]["layouts"][field]
        assert lay["spec"] == [None, None, None] and lay["shard"] == lay["global"], field


def test_companion_a_cache_laid_out_on_the_wrong_axis_is_caught(loops):
    assert loops["wrong-axis"]["trunk.k_BKSH"]["spec"] != [None, "tensor", None, None]


def test_shapes_that_do_not_divide_are_replicated_with_one_line(loops):
    lay = loops["cases"]["gqa-data2-tensor2-draft"]["layouts"]
    assert lay["seq_BS"]["shard"] == lay["seq_BS"]["global"]  # 3 rows over data=2: replicated
    notes = loops["notes"]
    assert sum("3 rows" in n and "replicated" in n for n in notes) == 1
    assert sum("1 kv head(s)" in n and "replicated over tensor" in n for n in notes) == 1
    assert all("\n" not in n for n in notes)


def test_caches_after_rejections_equal_a_fresh_prefill_on_the_mesh(loops):
    c = loops["caches"]
    assert 0 < c["accepted"] < c["reached"]
    assert c["max_diff"] < 2e-5
    assert c["layouts"]["trunk.k_BKSH"]["spec"] == [None, "tensor", None, None]


def test_sampled_distribution_on_tensor2(loops):
    assert loops["distribution"] == "ok"


def test_decode_eval_on_two_devices_equals_the_training_eval(cli):
    assert cli["eval"]["rc"] == 0, cli["eval"]["stderr"]
    assert "decoding on mesh data=1 fsdp=1 expert=1 tensor=2 (2 cpu devices)" in cli["eval"]["stderr"]
    rep, rec = cli["report"], {k: v for k, v in cli["train_eval"].items() if k != "step"}
    assert rep["mesh"].startswith("data=1 fsdp=1 expert=1 tensor=2")
    assert set(rep["validation"]) == set(rec)
    for k, v in rec.items():
        assert rep["validation"][k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert rep["decode"]["outputs_identical"]


def test_restore_lands_each_parameter_in_its_sharding(cli):
    r = cli["restore"]
    assert r["targeted"]  # orbax was given the training shardings as its target
    assert all(ok for ok, _ in r["shards"].values())
    assert any(smaller for _, smaller in r["shards"].values())  # tensor=2 really splits parameters
    # companion: reading whole arrays onto the host first, then placing them, is told apart
    assert not cli["whole_first"]["targeted"]


@pytest.mark.parametrize("name,says", [
    ("product", "but 2 device(s) are available"),
    ("dense-expert", "mesh.expert=2 splits routed experts, but this model has none"),
    ("not-mesh", "decode.py overrides only the mesh"),
])
def test_bad_meshes_are_one_line_exit_2(cli, name, says):
    bad = cli["bad"][name]
    assert bad["rc"] == 2
    lines = bad["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], bad["stderr"]


def _decode_here(argv: list[str], capsys) -> tuple[int, str]:
    """decode.py in this (one-device) process: exit status and stderr."""
    from mtpjax.cli.decode import main

    rc = main(argv)
    return rc, capsys.readouterr().err


def test_a_run_trained_on_two_devices_evaluates_on_one_after_one_line(cli, tmp_path, capsys):
    """The run's own mesh (tensor=2) does not fit this process's one device: decode.py decodes there, says so in one
    line naming the override, and its eval equals the training eval on 2 devices."""
    report = tmp_path / "eval.json"
    rc, err = _decode_here(["--run-dir", cli["run"], "--eval", "--eval-prompts", "1", "--prompt-len", "8",
                            "--max-new-tokens", "8", "--json", str(report)], capsys)
    assert rc == 0, err
    (line,) = [ln for ln in err.splitlines() if "the run's mesh" in ln]
    assert line == ("decode.py: the run's mesh data=1 fsdp=1 expert=1 tensor=2 needs 2 devices and 1 is here; "
                    "decoding on one device (pass mesh.tensor=1 to decode on one device)")
    assert "decoding on mesh" not in err
    rep, rec = json.loads(report.read_text()), {k: v for k, v in cli["train_eval"].items() if k != "step"}
    assert rep["mesh"] == "one device"
    for k, v in rec.items():
        assert rep["validation"][k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_companion_the_same_mesh_given_as_an_override_is_still_refused(cli, capsys):
    rc, err = _decode_here(["--run-dir", cli["run"], "--prompt", "ab", "--max-new-tokens", "2", "mesh.tensor=2"],
                           capsys)
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and "but 1 device(s) are available" in line


def test_the_one_device_note_names_the_overrides_for_the_devices_here():
    from mtpjax.config import MeshConfig, ModelConfig
    from mtpjax.decode.mesh import fallback_note

    heads4, heads5 = ModelConfig(n_heads=4, n_kv_heads=1), ModelConfig(n_heads=5, n_kv_heads=1)
    assert fallback_note(heads4, MeshConfig(), 2, "") is None  # a one-device run decodes on one device anyway
    assert fallback_note(heads4, MeshConfig(data=2, tensor=2), 2, "").endswith(
        "needs 4 devices and 2 are here; decoding on one device (pass mesh.data=1 to decode over all 2)")
    assert fallback_note(heads5, MeshConfig(tensor=2), 4, "").endswith(
        "(pass mesh.data=4 mesh.tensor=1 to decode over all 4)")  # 5 heads do not split 4 ways: rows do
    assert "does not suit this model (5 heads)" in fallback_note(heads5, MeshConfig(tensor=2), 2, "5 heads")


def test_generation_on_the_mesh_keys_its_calibrations_by_the_mesh(cli):
    assert cli["generate"]["rc"] == 0, cli["generate"]["stderr"]
    assert "decoding on mesh data=1 fsdp=1 expert=1 tensor=2" in cli["generate"]["stderr"]
    (tag,) = cli["calibration_tags"]
    assert tag.endswith("step 4 mesh data=1 fsdp=1 expert=1 tensor=2 (2 cpu devices)")


def test_a_tensor_axis_that_splits_no_heads_is_refused():
    from types import SimpleNamespace

    from mtpjax.decode.mesh import check_mesh
    from mtpjax.config import ModelConfig
    from mtpjax.parallel.sharding import MeshError

    with pytest.raises(MeshError, match="mesh.tensor=3 does not divide the model's 4 attention heads"):
        check_mesh(ModelConfig(n_heads=4, n_kv_heads=1), SimpleNamespace(shape={"tensor": 3, "expert": 1}))


def test_streamed_commits_reach_the_callback_in_order_whatever_order_they_arrive_in():
    """On a mesh the loop's emissions are unordered effects; the host orders them by their sequence number."""
    from mtpjax.decode import stream

    heard = []
    with stream.registered(lambda toks, counts: heard.append(int(toks[0, 0]))) as sid:
        for seq in (1, 0, 3, 2):
            stream.emit(sid, seq, [[10 + seq]], [1])
    assert heard == [10, 11, 12, 13]
