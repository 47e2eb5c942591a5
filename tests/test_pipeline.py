"""Pipeline stages (mesh.stage, parallel/pipeline.py): GPipe == no stages in float32 on 4 simulated devices (in a
subprocess), the bubble, and the config errors of a split the trunk does not allow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from train_helpers import PATIENT_COLLECTIVES, write_corpus

from mtpjax.config import ConfigError, load_config
from mtpjax.parallel.pipeline import bubble, stage_lines
from mtpjax.parallel.sharding import MeshError, make_mesh

GRAD_RTOL = 1e-5  # float32 rounding of sums taken in another order (measured: below 1e-6)
METRIC_RTOL = 2e-6  # float32 rounding of one forward on another split


def test_bubble_is_idle_ticks_over_all_ticks():
    assert bubble(1, 8) == 0.0
    assert bubble(2, 4) == pytest.approx(1 / 5)
    assert bubble(4, 8) == pytest.approx(3 / 11)
    assert bubble(4, 8, repeats=4) == pytest.approx(3 / 35)  # a circular pipeline: R·M passes a stage


def test_plan_says_what_an_uneven_split_stores_and_pads():
    """18 blocks: 2 stages store 9 each; 4 stages ([5,5,4,4]) store all 18 (the stack's layout is the checkpoint's)
    and run 5 per tick, 2 of them padding; 2 stages circling 3 times gather 3 chunks of 3."""
    even = stage_lines(18 * 2**30, 2**30, 2, 4, 18)
    assert len(even) == 2 and "trunk blocks 9.000 GiB (9 of 18 blocks'" in even[1]
    uneven = stage_lines(18 * 2**30, 2**30, 4, 4, 18, (5, 5, 4, 4))
    assert "trunk blocks 18.000 GiB (18 of 18 blocks'" in uneven[1]
    assert "each tick runs 5 blocks on every stage (2 of the 20 padding" in uneven[2]
    circular = stage_lines(18 * 2**30, 2**30, 2, 4, 18, repeats=3)
    assert "(circular, mesh.stage_repeats=3), bubble (S-1)/(R·M+S-1) = 7.7%" in circular[0]  # 1 / (3·4 + 1)
    assert "stores its 9 contiguous blocks and gathers the 3 chunks of 3 it runs" in circular[2]


@pytest.mark.parametrize("overrides, match", [
    (["mesh.stage=2", "model.n_layers=4"], "mesh.stage.*model.scan_layers=true"),
    (["mesh.stage=3", "model.n_layers=4", "model.scan_layers=true"], "mesh.stage.*must divide model.n_layers=4"),
    (["mesh.stage=2", "mesh.stage_layers=[1,2,1]", "model.scan_layers=true"], "stage_layers.*2 numbers"),
    (["mesh.stage=2", "mesh.stage_layers=[3,2]", "model.scan_layers=true"], "stage_layers.*sum to model.n_layers=4"),
    (["mesh.stage=2", "mesh.stage_layers=[4,0]", "model.scan_layers=true"], "stage_layers.*at least one block"),
    (["mesh.stage=2", "mesh.stage_layers=[5,-1]", "model.scan_layers=true"], "stage_layers.*at least one block"),
    (["mesh.stage_repeats=2", "model.scan_layers=true"], "stage_repeats.*set mesh.stage >= 2"),
    (["mesh.stage=2", "mesh.stage_layers=[1,3]", "mesh.stage_repeats=2", "model.scan_layers=true"],
     "stage_repeats.*leave mesh.stage_layers empty"),
    (["mesh.stage=2", "mesh.stage_repeats=3", "model.n_layers=4", "model.scan_layers=true", "train.micro_batches=2"],
     r"stage_repeats' = 3 is invalid: must divide model.n_layers / mesh.stage = 2"),
    (["mesh.stage=2", "mesh.stage_repeats=2", "model.n_layers=4", "model.scan_layers=true"],
     "stage_repeats.*needs train.micro_batches >= mesh.stage=2"),
    (["mesh.stage_repeats=0"], "stage_repeats' = 0 is invalid: must be > 0"),
])
def test_a_split_the_trunk_cannot_take_names_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_stage_mesh_mismatch_names_the_stage_axis():
    with pytest.raises(MeshError, match=r"mesh stage\*data\*fsdp\*tensor = 2\*1\*1\*1 = 2 but 1 device"):
        make_mesh(load_config(None, ["mesh.stage=2", "model.scan_layers=true"]).mesh)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """tests/pipeline_worker.py's results (4 CPU devices, one subprocess)."""
    tmp = tmp_path_factory.mktemp("stages")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the worker adds its devices
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # as the slow tests compile (conftest): a quarter less time
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "pipeline_worker.py"), str(write_corpus(tmp)),
                           str(tmp), str(tmp / "out.json")], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


CASES = ["dense_d1_s2", "dense_d2_s2", "dense_d2_s4", "dense_d1_s4", "moe_d2_s2", "moe_d1_s4", "moe_d2_s2_e2",
         "dense_d1_s2_uneven", "moe_d2_s2_uneven", "dense_d2_s2_r2", "dense_d1_s2_r2_m2", "moe_d1_s2_r2"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_stages_give_the_unstaged_loss_metrics_and_gradient(staged, case):
    """S stages × M micro-batches == one device: every loss, per-depth metric, expert load and gradient."""
    out = staged[case]
    single, staged_m = out["single"], out["staged"]
    assert single.keys() == staged_m.keys() and "loss/mtp_1" in single
    for k, v in single.items():
        np.testing.assert_allclose(staged_m[k], v, rtol=METRIC_RTOL, atol=1e-7, err_msg=k)
    if case.startswith("moe"):
        assert "loss/moe_balance" in single and any(k.startswith("load/") for k in single)
    worst = max(out["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < GRAD_RTOL, worst


@pytest.mark.slow
def test_companion_a_tail_without_the_embeddings_gradient_is_caught(staged):
    """The MTP modules and the tied head read the embedding after the pipeline: dropping those uses' gradient leaves
    only the first stage's, which the equality above tells apart."""
    rel = staged["dropped_embedding_tail"]
    assert rel["embed"] > 100 * GRAD_RTOL
    assert max(v for k, v in rel.items() if k != "embed") < GRAD_RTOL  # nothing else moved


@pytest.mark.slow
def test_companion_an_uneven_split_whose_padding_runs_as_a_block_is_caught(staged):
    """mesh.stage_layers=[3,2] pads the second stage to 3 blocks; applied (not passed through), its padding repeats
    that stage's last block: the blocks' gradients are another model's (measured: off by ~97% of their size)."""
    worst = max(staged["unmasked_padding"]["grad_rel"].values())
    assert worst > 100 * GRAD_RTOL


@pytest.mark.slow
def test_companion_a_circular_pipeline_over_contiguous_chunks_is_caught(staged):
    """mesh.stage_repeats=2 with each stage's own contiguous blocks as its chunks runs blocks 0, 2, 1, 3: another
    model, which the circular cases' equality tells apart."""
    worst = max(staged["circular_out_of_order"]["grad_rel"].values())
    assert worst > 100 * GRAD_RTOL


@pytest.mark.slow
def test_a_circular_pipeline_idles_for_the_ticks_its_bubble_says(staged):
    """2 stages, 4 micro-batches, 4 blocks: GPipe runs 5 ticks of 2 blocks, 2 repeats run 9 ticks of one; every tick
    computes (the bubble's on stand-ins), so the trunk's MLP FLOPs per device fall by (R·M + S − 1) / (R·(M + S − 1))
    = 9/10, the bubble from 1/5 to 1/9."""
    f = staged["circular_flops"]
    assert f["gpipe"] > 0 and f["circular"] * 10 == f["gpipe"] * 9
    assert (bubble(2, 4), bubble(2, 4, repeats=2)) == pytest.approx((1 / 5, 1 / 9))


@pytest.mark.slow
def test_a_circular_pipeline_reads_its_chunks_weights_again_rather_than_keeping_a_copy_per_tick(staged):
    """With remat, each tick's block is read from the stage's stack inside the block's remat, so the backward keeps
    the stack once; the companion, reading it outside, keeps a copy per tick (measured: 9 ticks × one block's bytes
    more, 335 KB). At DeepSeek-V3's width that copy was 6 GiB a chip (docs/scaling-out.md)."""
    f = staged["circular_memory"]
    assert f["block_bytes"] > 0 and f["copied"] - f["circular"] >= (f["ticks"] - 1) * f["block_bytes"]


@pytest.mark.slow
def test_the_tail_runs_on_each_stages_share_of_the_rows(staged):
    """After the drain the head (and the MTP modules, the loss) run split over stage × data: each of 4 devices does
    a quarter of the one-device head's matmuls; the companion, a tail every stage repeats, does a half."""
    f = staged["tail_split"]
    assert f["single"] > 0
    assert f["staged"] == f["single"] / 4
    assert f["repeated"] == f["single"] / 2


@pytest.mark.slow
def test_where_a_micro_batch_s_rows_do_not_split_each_stage_runs_every_sth_micro_batch_s_tail(staged):
    """4 stages, 8 micro-batches of 2 rows: the rows do not split over the stages, so each stage runs the tail of
    micro-batches s, s + 4 (a quarter of the one-device head's matmuls); the companion, repeated on every stage,
    runs all of them. The 4-stage equality cases above hold the numbers."""
    f = staged["tail_split"]
    assert f["single_s4"] > 0
    assert f["staged_s4"] == f["single_s4"] / 4
    assert f["repeated_s4"] == f["single_s4"]


@pytest.mark.slow
def test_the_pipeline_boundary_moves_a_device_s_rows_not_the_batch(staged):
    """The drain (and its cotangent) moves each device's batch shard alone: on 2 stages × data 2 no collective of
    the backward moves more than the largest parameter or one device's rows of the residual stream."""
    assert staged["tail_split"]["oversized"] == []


@pytest.mark.slow
def test_companion_a_psum_drain_moves_the_whole_batch(staged):
    """psum_scatter over the manual stage axis: XLA gathers the data shards first, the whole batch crosses."""
    assert staged["tail_split"]["oversized_psum_drain"]


@pytest.mark.slow
def test_the_eval_step_runs_through_the_stages(staged):
    """On 2 stages × data 2 the eval step's metrics equal one device's, and each device computes what the pipeline
    gives it: half the blocks (plus the bubble's ticks, A + S − 1 of A) on half the rows, the tail on a quarter."""
    ev = staged["evaluation"]
    (single, f1), (stag, f2) = ev["single"], ev["staged"]
    assert set(stag) == set(single) and any(k.startswith("accept_prob/") for k in single)
    for k, v in single.items():
        assert stag[k] == pytest.approx(v, rel=METRIC_RTOL, abs=1e-7), k
    assert f2 < 0.4 * f1, (f2, f1)


@pytest.mark.slow
def test_the_eval_step_on_four_stages_with_micro_batches_side_by_side_gives_one_device_s_metrics(staged):
    """8 micro-batches of 2 rows on 4 stages (the tail of every 4th micro-batch on each stage): one device's metrics."""
    (single, _), (stag, _) = staged["evaluation"]["single_8"], staged["evaluation"]["staged_s4"]
    assert set(stag) == set(single) and any(k.startswith("accept_prob/") for k in single)
    for k, v in single.items():
        assert stag[k] == pytest.approx(v, rel=METRIC_RTOL, abs=1e-7), k


@pytest.mark.slow
def test_companion_an_unpipelined_eval_on_the_staged_mesh_runs_every_block(staged):
    """Unpipelined on the same mesh (the stages' blocks gathered), each device runs every block on its data shard."""
    (single, f1), (mets, f3) = staged["evaluation"]["single"], staged["evaluation"]["unpipelined"]
    assert mets["loss/main"] == pytest.approx(single["loss/main"], rel=METRIC_RTOL)  # the same numbers, elsewhere
    assert f3 > 0.45 * f1, (f3, f1)


@pytest.mark.slow
def test_twenty_staged_steps_end_at_the_unstaged_parameters(staged):
    res = staged["training"]
    np.testing.assert_allclose(res["losses"][1], res["losses"][0], rtol=1e-5)
    # The "within 1e-5 relative", of the parameters as one vector: ||staged - unstaged|| / ||unstaged||,
    # measured 1.2e-6 (one device with 4 micro-batches instead of 2: 7.9e-7)
    assert res["param_norm_rel"] < 1e-5, res["param_norm_rel"]
    # Leaf by leaf, the largest |difference| over the largest |value|: measured 4.4e-5 (the embedding; 1.9e-4 at
    # Adam's eps 1e-8): Adam's division by sqrt(v) + eps lifts float32 rounding of small gradients over 20 steps,
    # and 1e-5 is below the floor of any reordered sum: one device with 4 micro-batches instead of 2 ends 3.1e-5
    # away, data 2 3.8e-5, data 4 8.1e-5 (docs/scaling-out.md); a wrong gradient is off by > 1e-2.
    worst = max(res["param_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-4, worst


@pytest.mark.slow
def test_plan_reports_the_bubble_and_the_state_per_stage(capsys):
    from mtpjax.cli.plan import main as plan_main

    assert plan_main(["--config", "configs/tiny.yaml", "mesh.stage=2", "model.scan_layers=true",
                      "train.micro_batches=4"]) == 0
    out = capsys.readouterr().out
    assert "mesh.stage=2 x train.micro_batches=4 (GPipe), bubble (S-1)/(M+S-1) = 20.0%" in out
    assert "trunk blocks" in out and "MTP modules" in out
