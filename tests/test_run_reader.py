"""One reader of run directories (train.checkpoint.SavedRun): decode's load_model, export and init_from agree."""

from pathlib import Path

import pytest

from mtpjax.config import load_config
from mtpjax.convert.export import RunCheckpoint
from mtpjax.train import posttrain
from mtpjax.train.checkpoint import CheckpointError, load_model


def _missing(tmp: Path) -> Path:
    return tmp / "missing"


def _no_checkpoints(tmp: Path) -> Path:
    (tmp / "bare").mkdir()
    return tmp / "bare"


def _empty_checkpoints(tmp: Path) -> Path:
    (tmp / "empty" / "checkpoints").mkdir(parents=True)
    return tmp / "empty"


CASES = {"missing": (_missing, "is not a run directory"),
         "no checkpoints/": (_no_checkpoints, "holds no complete checkpoint (no checkpoints/ directory)"),
         "empty checkpoints/": (_empty_checkpoints, "holds no complete checkpoint; train it first")}


def _messages(tmp: Path, run: Path) -> list[str]:
    """What decode (load_model), export (RunCheckpoint) and train.init_from say about `run`, named alike."""
    out = []
    for read in (load_model, RunCheckpoint):
        with pytest.raises(CheckpointError) as e:
            read(run)
        out.append(str(e.value))
    cfg = load_config(None, [f"train.init_from={run}", f"train.run_dir={tmp / 'new'}"])
    with pytest.raises(CheckpointError) as e:
        posttrain.source_config(cfg)
    assert str(e.value).startswith(f"train.init_from '{run}' ")
    out.append(str(e.value).replace(f"train.init_from '{run}'", f"'{run}'"))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_decode_export_and_init_from_read_a_run_directory_alike(tmp_path, case):
    make, words = CASES[case]
    said = _messages(tmp_path, make(tmp_path))
    assert len(set(said)) == 1 and words in said[0] and "\n" not in said[0], said
    assert not (tmp_path / "new").exists()  # init_from refused before anything was written


def test_companion_the_readers_tell_the_cases_apart(tmp_path):
    """Companion: each case has its own message, so agreeing is not one message for everything."""
    said = {case: _messages(tmp_path, make(tmp_path))[0] for case, (make, _) in CASES.items()}
    assert len(set(said.values())) == len(CASES), said
