"""The targets `python -m mtpjax compile` accepts and the meshes it chooses: one that fills a target, and the candidates
`--search` ranks."""

import re

import pytest

from mtpjax.cli.compile import on_target
from mtpjax.config import MeshConfig, load_config
from mtpjax.parallel.sharding import MeshError
from mtpjax.parallel.targets import TargetError, parse_target
from mtpjax.train import meshes


def _cfg(name: str, *overrides: str):
    return load_config(f"configs/{name}.yaml", list(overrides))


def test_a_dense_config_fills_the_target_fully_sharded():
    assert meshes.fills(_cfg("small"), 8) == MeshConfig(fsdp=8)
    assert meshes.fills(_cfg("large"), 16) == MeshConfig(fsdp=8, tensor=2)  # its own tensor 2 kept


def test_a_mesh_the_batch_does_not_split_over_takes_more_ways_elsewhere():
    """gpu_moe's 64 rows in 16 micro-batches split over at most 4 batch shards: of 8 devices, the others split
    heads or experts; every device is used and the run could take it."""
    cfg = _cfg("gpu_moe")
    mesh = meshes.fills(cfg, 8)
    assert meshes.size(mesh) == 8 and meshes.usable(cfg, mesh, 16)
    assert mesh.data * mesh.fsdp * mesh.expert == 4


def test_companion_fsdp_alone_would_not_split_the_batch():
    assert not meshes.usable(_cfg("gpu_moe"), MeshConfig(fsdp=8), 16)


def test_candidates_fill_the_devices_and_put_the_cheap_axes_first():
    cfg = _cfg("small")
    found = meshes.candidates(cfg, 8, limit=None)
    assert found[0] == (MeshConfig(fsdp=8), 1) and (MeshConfig(fsdp=4, tensor=2), 1) in found[:3]
    assert all(meshes.size(m) == 8 and meshes.usable(cfg, m, a) for m, a in found)
    assert len(meshes.candidates(cfg, 8, limit=3)) == 3


def test_candidates_keep_the_config_s_pipeline_stages():
    """A staged config's candidates split the devices each stage holds; their overrides name the stages."""
    cfg = _cfg("tiny", "mesh.stage=2", "model.scan_layers=true")
    found = meshes.candidates(cfg, 8, limit=None)
    assert found and all(m.stage == 2 and meshes.size(m) == 8 for m, _ in found)
    assert meshes.overrides(found[0][0])[0] == "mesh.stage=2"
    assert meshes.fills(cfg, 8).stage == 2
    with pytest.raises(MeshError, match="^mesh.stage=2 does not divide the target's 9 devices"):
        meshes.candidates(cfg, 9, limit=None)


def test_an_moe_searches_expert_parallel_meshes_first():
    mesh, a = meshes.candidates(_cfg("gpu_moe"), 8, limit=1)[0]
    assert (mesh.expert, a) == (8, 8)  # 8 micro-batches: the 16 of one H200 would not split over 8 batch shards


def test_the_config_s_own_mesh_is_kept_when_it_has_the_target_s_devices():
    cfg = _cfg("large")
    assert on_target(cfg, [], parse_target("h100:8")) is cfg


def test_with_no_mesh_given_the_target_is_filled_and_said(capsys):
    cfg = on_target(_cfg("small"), [], parse_target("v5p-8"))
    assert cfg.mesh == MeshConfig(fsdp=4)
    err = capsys.readouterr().err
    assert err.startswith("compile: the config's mesh (one device) does not fill v5p-8's 4 devices; compiling on "
                          "fsdp 4 (mesh.data=1 mesh.fsdp=4 mesh.expert=1 mesh.tensor=1;"), err


def test_a_mesh_the_user_gave_that_does_not_fill_the_target_is_one_line():
    with pytest.raises(MeshError, match=r"^mesh fsdp 2 spans 2 device\(s\) but target v5p-8 has 4; give mesh\.\* "
                       r"overrides whose product is 4"):
        on_target(_cfg("small", "mesh.fsdp=2"), ["mesh.fsdp=2"], parse_target("v5p-8"))


def test_the_ranking_puts_what_does_not_fit_last_and_names_the_best():
    rows = [{"mesh": "fsdp 8", "micro_batches": 1, "overrides": ["mesh.fsdp=8"], "fits": True, "memory": 2**31,
             "estimate_s": 0.02, "bound": "hbm", "mfu": 0.4, "tokens_per_s": 3.2e6, "collective_fraction": 0.05},
            {"mesh": "tensor 8", "micro_batches": 1, "overrides": ["mesh.tensor=8"], "fits": False,
             "why": "train_step does not fit on H100 by 1.00 GiB per device"}]
    text = meshes.ranking(rows, "h100:8").splitlines()
    assert text[2].split()[:3] == ["1", "fsdp", "8"] and text[3].split()[0] == "-" and "does not fit" in text[3]
    assert text[-1] == "best: mesh.fsdp=8"


def test_a_missing_compiler_stops_the_search_instead_of_ranking_nothing(monkeypatch):
    """Every candidate would fail the same way: the search says why once (TargetError), not "no candidate fits"."""
    from mtpjax.parallel.targets import TargetError
    from mtpjax.train import aot

    def no_compiler(*args, **kwargs):
        raise TargetError("cannot describe target 'h100:8' (topology not implemented for cuda); install its compiler")

    monkeypatch.setattr(aot, "compile_report", no_compiler)
    cfg = _cfg("small")
    with pytest.raises(TargetError, match="install its compiler"):
        meshes.search(cfg, parse_target("h100:8"), 2, place=lambda o: cfg)


@pytest.mark.parametrize("name, says", [
    ("v5p-6", "v5p-6 is not a slice size; use one of v5p-8, "),  # v5p counts TensorCores, two a chip
    ("v5e-3", "v5e-3 is not a slice size; use one of v5e-1, "),
    ("h100:9", "a GPU host holds 1 to 8 GPUs; write hosts x GPUs, e.g. h100:2x8"),
    ("h100:0x8", "a GPU host holds 1 to 8 GPUs"),
])
def test_an_impossible_slice_or_host_names_the_sizes_there_are(name, says):
    with pytest.raises(TargetError, match=re.escape(f"target '{name}': {says}")):
        parse_target(name)


@pytest.mark.parametrize("argv, says", [
    (["--search", "-1"], "--search -1 must be >= 1"),
    (["--json", "FILE/report.json"], "--json FILE/report.json: 'FILE' is a file; give another path"),
    (["--json", "DIR"], "--json DIR is a directory; give a file path"),
    (["--dump-hlo", "FILE/hlo"], "--dump-hlo FILE/hlo: 'FILE' is a file; give another path"),
])
def test_compile_s_bad_flags_are_one_line_before_any_compile(tmp_path, capsys, argv, says):
    """Checked first, creating nothing: a compile takes minutes, and its report must have somewhere to go."""
    from train_helpers import one_line_error

    from mtpjax.cli.compile import main

    (tmp_path / "FILE").write_text("")
    argv = [a.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path)) for a in argv]
    says = says.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path))
    err = one_line_error(capsys, main, ["--config", "configs/tiny.yaml", "--target", "v5e-4", *argv])
    assert says in err and sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]
