"""Resuming a run directory: what a refused resume leaves behind, and what is compared before resuming."""

import shutil
from pathlib import Path

from train_helpers import cli_args, one_line_error

from mtpjax.cli.train import main
from mtpjax.config import replace


def _copy_run(tiny_run, tmp: Path):
    cfg, run = tiny_run
    shutil.copytree(run, tmp / "run")
    return replace(cfg, [f"train.run_dir={tmp / 'run'}"]), tmp / "run"


def _files(run: Path) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_resume_refused_at_the_checkpoint_leaves_the_run_dir_unchanged(tiny_run, tmp_path, capsys):
    """train.batch_size may not change on resume (the data position): refused only once the checkpoint is read, but
    config.yaml is not rewritten with the refused config, so the original command still resumes."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    before = _files(run)
    err = one_line_error(capsys, main, cli_args(cfg, "train.batch_size=4"))
    assert "batch_size=8 (now 4)" in err
    assert _files(run) == before
    assert main(cli_args(cfg, "train.steps=8")) == 0


def test_without_config_yaml_the_checkpoint_config_is_the_identity(tiny_run, tmp_path, capsys):
    """A run dir whose config.yaml was deleted is still compared: with the config its latest checkpoint saved."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    (run / "config.yaml").unlink()
    before = _files(run)
    err = one_line_error(capsys, main, cli_args(cfg, "model.rope_theta=500.0"))  # same shapes: would restore
    assert "model.rope_theta: 10000.0 -> 500.0" in err and "--fresh" in err
    assert _files(run) == before


def _swap_two_ids(path: Path) -> None:
    """Edit a tokenizer.json in place: two tokens trade ids (the file's name and size stay)."""
    import json

    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (280, 281))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))


def test_a_tokenizer_file_changed_in_place_is_refused_on_resume(tmp_path, capsys):
    """data.tokenizer names the same file, whose ids changed since the run began: resuming would feed the trained
    embedding other ids and overwrite the run's tokenizer/; refused in one line, the run dir untouched."""
    from train_helpers import tiny_cfg, write_corpus

    from mtpjax.data.tokenizer import train_bpe

    corpus = write_corpus(tmp_path)
    train_bpe(iter([corpus.read_text()]), 300).save(tmp_path / "tok")
    path = tmp_path / "tok" / "tokenizer.json"
    cfg = tiny_cfg(tmp_path, f"data.tokenizer={path}", "model.vocab_size=300", "train.steps=1",
                   "train.eval_batches=0", corpus=corpus)
    assert main(cli_args(cfg)) == 0
    run = Path(cfg.train.run_dir)
    _swap_two_ids(path)
    before = _files(run)
    err = one_line_error(capsys, main, cli_args(cfg, "train.steps=2"))
    assert f"data.tokenizer={path} gives other token ids" in err and "--fresh" in err
    assert _files(run) == before


def test_fresh_refuses_a_run_dir_that_holds_the_current_directory(tmp_path, capsys, monkeypatch):
    """--fresh with train.run_dir=. (or a parent of the working directory) cannot move it aside: one line, nothing
    moved (it was a traceback after the data was prepared)."""
    from train_helpers import tiny_cfg

    here = tmp_path / "work" / "sub"
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for run_dir in (".", str(tmp_path / "work")):
        cfg = tiny_cfg(tmp_path, f"train.run_dir={run_dir}")
        err = one_line_error(capsys, main, cli_args(cfg, "--fresh"))
        assert "--fresh would move train.run_dir" in err and "current directory" in err
    assert not [p for p in tmp_path.rglob("*") if ".old-" in p.name]
    assert (here / "notes.txt").read_text() == "mine"



def test_fresh_refuses_a_directory_that_holds_no_run(tmp_path, capsys):
    """--fresh moves a run aside; a non-empty directory with none of a run's files (train.run_dir=~, a project) is
    refused with one line and left where it is."""
    from train_helpers import tiny_cfg

    mine = tmp_path / "projects"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    err = one_line_error(capsys, main, cli_args(tiny_cfg(tmp_path, f"train.run_dir={mine}"), "--fresh"))
    assert "holds files but no run" in err and "config.yaml, checkpoints, tensorboard, tokenizer" in err
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt", "src"]


def test_companion_fresh_moves_a_run_that_holds_the_user_s_files_too(tiny_run, tmp_path):
    """A run's directory with a file of the user's beside it is still a run: --fresh moves the whole of it aside."""
    from mtpjax.train.loop import train

    cfg, run = _copy_run(tiny_run, tmp_path)
    (run / "notes.txt").write_text("mine")
    assert train(replace(cfg, ["train.steps=1"]), fresh=True)["step"] == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "notes.txt").read_text() == "mine"

def test_turning_gradient_clipping_off_on_resume_is_refused_by_name(tiny_run, tmp_path, capsys):
    """optim.grad_clip=0 drops the clipping stage from the optimizer state: every checkpoint then failed to restore
    and the run was told to start over (--fresh). Now one line names the key; another clipping value resumes."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    before = _files(run)
    err = one_line_error(capsys, main, cli_args(cfg, "optim.grad_clip=0"))
    assert "optim.grad_clip=1.0" in err and "optim.grad_clip > 0" in err and "can be restored" not in err
    assert _files(run) == before
    assert main(cli_args(cfg, "train.steps=8", "optim.grad_clip=0.5")) == 0


def test_a_corpus_moved_elsewhere_resumes_and_a_changed_one_is_refused(tmp_path, capsys):
    """data.paths says where the corpus lies, not what it is: a run resumes from its corpus moved (the data position
    compares the tokens' content hashes); moved and changed, it is refused with one line naming changed data."""
    from train_helpers import tiny_cfg, write_corpus

    (tmp_path / "a").mkdir()
    cfg = tiny_cfg(tmp_path, "train.steps=2", "checkpoint.every=2", corpus=write_corpus(tmp_path / "a"))
    assert main(cli_args(cfg)) == 0
    (tmp_path / "a").rename(tmp_path / "b")
    moved = replace(cfg, [f"data.paths={tmp_path / 'b' / 'corpus.txt'}", "train.steps=4"])
    assert main(cli_args(moved)) == 0
    assert str(tmp_path / "b") in (tmp_path / "run" / "config.yaml").read_text()
    with open(tmp_path / "b" / "corpus.txt", "a") as f:
        f.write("\ndef more(): pass\n" * 50)
    err = one_line_error(capsys, main, cli_args(replace(moved, ["train.steps=6"])))
    assert "other tokens in the corpus (files or the tokenizer changed since)" in err


def test_a_trained_bpe_whose_corpus_changed_names_the_corpus(tmp_path, capsys):
    """data.tokenizer=bpe is trained on the corpus: a changed corpus trains other ids, and the refusal says to restore
    the corpus (it said to put the tokenizer back "at bpe", which is no path)."""
    from train_helpers import tiny_cfg

    cfg = tiny_cfg(tmp_path, "data.tokenizer=bpe", "data.bpe_vocab_size=300", "model.vocab_size=300",
                   "train.steps=1", "train.eval_batches=0")
    assert main(cli_args(cfg)) == 0
    corpus = Path(cfg.data.paths[0])
    corpus.write_text(corpus.read_text().replace("def ", "lambda_"))
    err = one_line_error(capsys, main, cli_args(cfg, "train.steps=2"))
    assert "data.tokenizer=bpe gives other token ids" in err and "which changed since: restore the corpus" in err
    assert "back at bpe" not in err


def test_a_run_resumes_with_another_remat(tiny_run, tmp_path, capsys):
    """model.remat says what the backward keeps, not what it computes (test_model: remat changes nothing): a run that
    runs out of memory resumes with remat on. It was refused as 'a different model config'."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    assert main(cli_args(cfg, "train.steps=8", "model.remat=full")) == 0
    assert "model.remat" not in capsys.readouterr().err
    err = one_line_error(capsys, main, cli_args(cfg, "train.steps=9", "model.n_layers=3"))  # a model key still is
    assert "model.n_layers: 2 -> 3" in err
