"""Bad input fuzzing: configs, corpora, tokenizers, token arrays and decode requests.

Each bad input ends in one `error: ...` line with exit status 2 (or is handled correctly), never a traceback,
never a hang, and never changes the run directory (hashed before and after).
"""

import functools
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_reliability import tree_hash
from train_helpers import cli_args, tiny_cfg

from mtpjax.cli import train as train_cli
from mtpjax.cli import decode as decode_cli
from mtpjax.config import Config, ConfigError, KEYS, load_config

REPO = Path(__file__).resolve().parent.parent
WRONG = [None, [], {}, [1, 2], {"x": 1}, "abc", "", True, False, -1, 0, -(10**9), 0.5, -0.5, float("nan"),
         float("inf"), float("-inf"), "1e999", "nan", "@@", "\udcff"[:0] + "ü"]


def _one_line_error(capsys, fn, argv) -> str:
    capsys.readouterr()
    try:
        code = fn(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("WARNING:absl")]
    assert code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


# ----------------------------------------------------------------------------- configs


def _mutations(rng: random.Random, n: int):
    """(description, raw config dict) pairs: wrong types/values, unknown keys and sections, scalars for sections."""
    keys = list(KEYS)
    for _ in range(n):
        raw: dict = {}
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            key = rng.choice(keys)
            sec, name = key.split(".")
            if r < 0.1 and isinstance(raw.get(sec, {}), dict):  # (a section already made a scalar stays one)
                raw.setdefault(sec, {})[name + rng.choice(["_", "s", "x"])] = 1
            elif r < 0.15:
                raw[sec + "z"] = {name: 1}
            elif r < 0.2:
                raw[sec] = rng.choice(WRONG[1:])
            elif isinstance(raw.get(sec, {}), dict):
                raw.setdefault(sec, {})[name] = rng.choice(WRONG)
        yield raw


def test_config_fuzz_is_a_config_or_one_line_config_error(tmp_path):
    rng, errors, n = random.Random(0), 0, 400
    for i, raw in enumerate(_mutations(rng, n)):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(raw, allow_unicode=True))
        overrides = [f"{s}.{k}={json.dumps(v)}" for s, sec in raw.items() if isinstance(sec, dict)
                     for k, v in sec.items()]
        for load in (functools.partial(load_config, path), functools.partial(load_config, None, overrides)):
            try:
                assert isinstance(load(), Config)
            except ConfigError as e:
                errors += 1
                assert "\n" not in str(e) and str(e), raw
    assert errors > n  # most mutations are wrong (some, like a wrong bool's fallback, are legitimately fine)


def test_non_finite_numbers_are_refused():
    for v in (".inf", "-.inf", ".nan", "1e999"):
        with pytest.raises(ConfigError, match="optim.lr.*not inf or nan"):
            load_config(None, [f"optim.lr={v}"])


@pytest.fixture
def trained(tiny_run):
    """The session's shared trained run (conftest.tiny_run): these tests check they leave it unchanged."""
    return tiny_run


def test_bad_configs_on_an_existing_run_change_nothing(trained, tmp_path, capsys):
    cfg, run = trained
    before = tree_hash(run)
    rng, tried = random.Random(1), 0
    for raw in _mutations(rng, 60):
        try:
            load_config(None, [f"{s}.{k}={json.dumps(v)}" for s, sec in raw.items() if isinstance(sec, dict)
                               for k, v in sec.items()])
            continue  # a valid config would train; only the wrong ones go through the CLI
        except ConfigError:
            pass
        merged = cfg.to_dict()
        for s, sec in raw.items():
            merged[s] = {**merged[s], **sec} if isinstance(sec, dict) and isinstance(merged.get(s), dict) else sec
        path = tmp_path / f"bad{tried}.yaml"
        path.write_text(yaml.safe_dump(merged, allow_unicode=True))
        _one_line_error(capsys, train_cli.main, ["--config", str(path)])
        tried += 1
        if tried == 12:
            break
    assert tried == 12 and tree_hash(run) == before


# ----------------------------------------------------------------------------- corpora, tokenizers, arrays


def _write(tmp: Path, name: str, data) -> Path:
    p = tmp / name
    p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return p


def _link(tmp: Path, name: str, target: str) -> Path:
    (tmp / name).symlink_to(target)
    return tmp / name


def _npy(tmp: Path, name: str, arr, **kw) -> Path:
    p = tmp / name
    np.save(p, arr, **kw)
    return p


BAD_DATA = {  # name: (make files -> overrides, words the error names)
    "empty text file": (lambda t: [f"data.paths={_write(t, 'e.txt', '')}"], "e.txt"),
    "jsonl that is not json": (lambda t: [f"data.paths={_write(t, 'd.jsonl', b'{oops')}"], "d.jsonl:1"),
    # a file that lists but does not read (an I/O error; for a user, no permission): was an OSError traceback
    "text file whose read fails": (lambda t: ["data.paths=/proc/self/mem"], "'/proc/self/mem' cannot be read"),
    "jsonl file whose read fails": (
        lambda t: [f"data.paths={_link(t, 'mem.jsonl', '/proc/self/mem')}"],
        "mem.jsonl' cannot be read (Input/output error); fix data.paths"),
    "tokenizer file that does not parse": (
        lambda t: [f"data.tokenizer={_write(t, 'tok.json', b'{not json at all')}"], "does not parse"),
    "tokenizer json that is not a tokenizer": (
        lambda t: [f"data.tokenizer={_write(t, 'tok2.json', json.dumps({'model': 3}))}"], "tok2.json"),
    "sentencepiece model of random bytes": (
        lambda t: [f"data.tokenizer={_write(t, 'sp.model', bytes(range(256)) * 8)}"], "sp.model"),
    "array ids beyond the vocab": (
        lambda t: ["data.source=array", f"data.paths={_npy(t, 'ids.npy', np.arange(0, 5000, dtype=np.int32))}"],
        "outside the tokenizer's vocab"),
    "negative array ids": (
        lambda t: ["data.source=array", f"data.paths={_npy(t, 'neg.npy', -np.ones(4000, np.int64))}"], "-1"),
    "float array": (lambda t: ["data.source=array", f"data.paths={_npy(t, 'f.npy', np.ones(4000))}"], "float64"),
    "pickled object array": (
        lambda t: ["data.source=array", f"data.paths={_npy(t, 'o.npy', np.array([{}], object), allow_pickle=True)}"],
        "o.npy"),
    "truncated npy": (
        lambda t: ["data.source=array",
                   "data.paths=" + str(_write(t, "cut.npy",
                                              _npy(t, "full.npy", np.ones(4000, np.int32)).read_bytes()[:500]))],
        "cut.npy"),
    "random bytes npy": (lambda t: ["data.source=array", f"data.paths={_write(t, 'r.npy', bytes(range(256)))}"],
                         "r.npy"),
    "odd-sized bin": (lambda t: ["data.source=array", f"data.paths={_write(t, 'odd.bin', b'abc')}"], "odd"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_one_line_exit_2_and_leaves_the_run_dir_alone(tmp_path, capsys, case):
    make, words = BAD_DATA[case]
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("a user's file")
    before = tree_hash(run)
    cfg = tiny_cfg(tmp_path, f"train.run_dir={run}")
    err = _one_line_error(capsys, train_cli.main, cli_args(cfg, *make(tmp_path)))
    assert words in err, err
    assert tree_hash(run) == before


def test_bad_data_leaves_no_new_run_dir_behind(tmp_path, capsys):
    """A run refused for its data leaves neither its run dir nor the parents it created; an existing parent stays."""
    run = tmp_path / "new" / "runs" / "r"
    cfg = tiny_cfg(tmp_path, f"train.run_dir={run}")
    err = _one_line_error(capsys, train_cli.main,
                          cli_args(cfg, "data.source=array", f"data.paths={_write(tmp_path, 'odd.bin', b'abc')}"))
    assert "odd" in err and not (tmp_path / "new").exists() and tmp_path.is_dir()


def test_non_utf8_and_binary_text_is_read_with_replacement(tmp_path):
    from mtpjax.data import prepare

    f = _write(tmp_path, "latin.txt", "caf\xe9 au lait\n".encode("latin-1") * 200 + bytes(range(256)) * 20)
    cfg = tiny_cfg(tmp_path, f"data.paths={f}")
    with pytest.warns(UserWarning, match="not valid UTF-8"):
        prepared = prepare(cfg.data)
    text = prepared.tokenizer.decode(np.asarray(prepared.train_tokens[:40]).tolist())
    assert text.startswith("caf\ufffd au lait")


# ----------------------------------------------------------------------------- decode requests


DECODE = [  # (argv after --run-dir, expected exit status, words in the error or the prompts it decodes)
    (["--prompt", "\x00\x01\x7f🙂 漢字 \ufffd"], 0, ["\x00\x01\x7f🙂 漢字 \ufffd"]),
    (["--prompt", "\udcff\udcfe abc"], 0, ["\ufffd\ufffd abc"]),  # non-UTF-8 command-line bytes
    # latin.txt below: invalid bytes become U+FFFD, only the \n, \t and \\ escapes are read
    (["--prompts-file", "{latin}"], 0, ["caf\ufffd", "\\x\\u12 \n ok", "\ufffd\ufffd"]),
    (["--prompts-file", "{empty}"], 2, "no prompts"),
    (["--prompts-file", "{blank}"], 2, "blank.txt' line 2 is empty; remove its blank lines"),  # was "empty prompt"
    (["--prompts-file", "/proc/self/mem"], 2, "'/proc/self/mem' cannot be read (Input/output error)"),  # a failing read
    (["--prompt", "x", "--max-new-tokens", str(10**12)], 2, "exceeds the cache"),
    (["--prompt", "x", "--max-new-tokens", str(10**10), "--max-len", str(10**12)], 2, "KV cache"),
    (["--prompt", "x", "--max-new-tokens", "-5"], 2, "max_new_tokens=-5"),
    (["--prompt", "x", "--max-len", "-1"], 2, "max_len=-1"),
    (["--prompt", "x", "--num-draft", str(10**6)], 2, "--num-draft"),
    (["--prompt", "x", "--num-draft", "-3"], 2, "--num-draft -3"),  # the flag spells decode.draft now
    # one check, the sampler's, for decode.py, generate and Generator: it names the parameter, as top_p's and top_k's
    (["--prompt", "x", "--temperature", "nan"], 2, "temperature=nan must be a finite number >= 0"),
    (["--prompt", "x", "--top-p", "2"], 2, "top_p"),
    (["--prompt", "x", "--top-k", "-1"], 2, "top_k"),
    (["--prompt", "x", "--step", str(10**30)], 2, "no checkpoint at step"),
    (["--prompt", "x", "--seed", str(10**23)], 2, f"seed={10**23} must be between -2**63 and 2**63"),  # was a traceback
    (["--prompt", "x", "--step", "-1"], 2, "no checkpoint at step"),
    (["--prompt", "x", "--max-new-tokens", "1e9"], 2, "invalid int"),
]


@pytest.mark.parametrize("argv,code,words", DECODE, ids=[" ".join(a)[:40] for a, _, _ in DECODE])
def test_decode_requests_error_in_one_line_or_work(trained, tmp_path, capsys, argv, code, words):
    _, run = trained
    latin = _write(tmp_path, "latin.txt", b"caf\xe9\n\\x\\u12 \\n ok\n\xff\xfe\n")
    empty = _write(tmp_path, "empty.txt", "")
    blank = _write(tmp_path, "blank.txt", "a\n\nb\n")
    argv = ["--run-dir", str(run), *(a.format(latin=latin, empty=empty, blank=blank) for a in argv)]
    if code == 0:
        argv += ["--max-new-tokens", "4"]
    before = tree_hash(run)
    if code == 2:
        assert words in _one_line_error(capsys, decode_cli.main, argv)
    else:
        assert decode_cli.main(argv) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        assert out.out == _greedy_output(run, words)  # each prompt, continued as generate continues it
    assert tree_hash(run) == before


def test_prompts_read_from_a_pipe(trained, tmp_path, capsys):
    """--prompts-file <(...) or /dev/stdin names a pipe, not a regular file: its prompts are decoded (it was refused
    as a file that does not exist)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.write_text("def f(\nimport os\n"), daemon=True).start()
    assert decode_cli.main(["--run-dir", str(trained[1]), "--prompts-file", str(fifo), "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == _greedy_output(trained[1], ["def f(", "import os"])


def _greedy_output(run, prompts: list[str]) -> str:
    """What decode.py prints for these prompts at 4 new tokens, greedy: one prompt streamed, several in blocks."""
    from mtpjax.decode import generate
    from mtpjax.train.checkpoint import load_model

    _, model, tok = load_model(run)
    outs = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=4, eos_id=tok.eos_id).tokens
    if len(prompts) == 1:
        return f"{prompts[0]}{tok.decode(outs[0])}\n"
    return "".join(f"### {p!r}\n{p}{tok.decode(o)}\n" for p, o in zip(prompts, outs))


def test_decode_of_a_run_with_a_corrupt_tokenizer(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    for f in (run / "tokenizer").iterdir():
        f.write_bytes(b"\xff{garbage")
    before = tree_hash(run)
    assert "tokenizer" in _one_line_error(capsys, decode_cli.main, ["--run-dir", str(run), "--prompt", "x"])
    assert tree_hash(run) == before


@pytest.mark.slow
def test_non_utf8_argv_through_a_real_process(trained):
    p = subprocess.run([sys.executable, str(REPO / "decode.py"), "--run-dir", str(trained[1]), "--prompt",
                        b"\xff\xfe caf\xe9", "--max-new-tokens", "3"], capture_output=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                            "MTPJAX_CACHE_DIR": os.environ["MTPJAX_CACHE_DIR"]})
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr[-2000:]
