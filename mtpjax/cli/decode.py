"""The decode.py command line: generation with streaming output, and `--eval` of a checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from mtpjax.cli.args import Parser, check_modes, command, draft_flag, mode_flag, writable
from mtpjax.cli.decode_eval import eval_drafts, evaluate
from mtpjax.config import DecodeConfig, choices
from mtpjax.decode import api, autodraft
from mtpjax.decode.cache import cache_bytes, rows
from mtpjax.decode.host import DecodeError, make_loop
from mtpjax.decode.mesh import describe
from mtpjax.decode.prompts import read_prompts_file
from mtpjax.decode.text import encode
from mtpjax.drafts import Auto, DraftError, Tree, parse
from mtpjax.eval import verdict
from mtpjax.parallel import console
from mtpjax.eval.log import agreement_at


def parser() -> Parser:
    p = Parser(prog="decode.py", description=__doc__)
    p.add_argument("--run-dir", required=True, help="a run directory written by train.py")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help="a file with one prompt per line (\\n escapes allowed)")
    src.add_argument("--eval", action="store_true", help="validation metrics + speculative speed report")
    src.add_argument("--tasks", help="lm-eval tasks, comma-separated (the shipped ones: mtpjax): the harness's table "
                                     "and what speculative generation did (--limit, --num-fewshot, --batch-size)")
    p.add_argument("--num-draft", type=_num_draft, default=None,
                   help="drafts per round, or auto: measure plain, chains up to the proposer's most drafts (the MTP "
                        "modules' depth, one more for mtp1; n-gram lookup's longest suffix; a draft model by its size "
                        "against the target's) and the small trees of autodraft.PROBED_TREES on the prompts, and use "
                        "the fastest (sets decode.draft; default: decode.draft)")
    p.add_argument("--proposer", choices=choices(DecodeConfig, "proposer"), default=None,
                   help="mtp: the run's MTP modules (module k drafts token k); mtp1: module 1 drafts every token; "
                        "ngram: prompt lookup; model: the --draft-run-dir model (default: decode.proposer, or model "
                        "with --draft-run-dir)")
    p.add_argument("--tree", type=_tree, default=None,
                   help="draft a static tree with the MTP modules instead of a chain: children per node at each depth "
                        "(2x2x1: top-2 at depths 1 and 2, top-1 at 3) or each node's parent (-1,-1,0,0); +ngramL adds "
                        "n-gram lookup's L drafts as one more branch (2x2+ngram3) (sets decode.draft)")
    p.add_argument("--draft-run-dir", default=None,
                   help="a run trained with the same tokenizer (e.g. configs/draft_tiny.yaml) whose model drafts")
    _mode_flags(p)
    p.add_argument("mesh_overrides", nargs="*", metavar="mesh.AXIS=N",
                   help="the mesh to decode on: the run's config's mesh with these overrides (mesh.tensor=2 splits "
                        "heads, MLP and vocabulary over 2 devices; mesh.data, mesh.fsdp, mesh.expert); the product is "
                        "the device count")
    return p


def _mode_flags(p: Parser) -> None:
    """The flags only some modes read (generation, --eval, --tasks), each refused in the others."""
    # generation's flags: --tasks samples and stops as each task says; --eval measures greedy decoding
    gen, gen_eval = ("--prompt", "--prompts-file"), ("--prompt", "--prompts-file", "--eval")
    mode_flag(p, gen, "--temperature", type=float, default=None, help="sampling temperature; 0 = greedy")
    mode_flag(p, gen, "--top-k", type=int, default=None, help="top-k filter (0 = off)")
    mode_flag(p, gen, "--top-p", type=float, default=None, help="nucleus filter (1 = off)")
    mode_flag(p, gen_eval, "--max-new-tokens", type=int, default=None, help="tokens generated per prompt")
    mode_flag(p, (*gen, "--tasks"), "--seed", type=int, default=0, help="sampling seed")
    mode_flag(p, gen_eval, "--max-len", type=int, default=None, help="KV cache capacity (default: decode.max_len)")
    mode_flag(p, gen, "--stats", switch=True, help="print acceptance statistics after generating")
    mode_flag(p, gen, "--recalibrate", switch=True,
              help="auto: measure the candidates again instead of reusing a saved measurement")
    mode_flag(p, gen, "--calibration-file", default=None,
              help="auto: where measurements are saved (default: $MTPJAX_CACHE_DIR or ~/.cache/mtpjax, "
                   "decode_calibration.json)")
    mode_flag(p, ("--eval",), "--eval-batches", type=int, default=None,
               help="validation batches (default: train.eval_batches, the training eval's, or 8)")
    mode_flag(p, ("--eval",), "--eval-prompts", type=int, default=8, help="held-out prompts")
    mode_flag(p, ("--eval",), "--prompt-len", type=int, default=64, help="tokens per held-out prompt")
    mode_flag(p, ("--eval", "--tasks"), "--json", help="also write the report as JSON here")
    mode_flag(p, ("--tasks",), "--limit", type=float, default=None, help="documents per task (default: all)")
    mode_flag(p, ("--tasks",), "--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    mode_flag(p, ("--tasks",), "--batch-size", type=int, default=None, help="rows of one compiled batch (default 16)")


def _mesh(args):
    """The mesh to decode on (None: one device): the checkpoint's config's mesh with the command's mesh.* overrides;
    MeshError (exit 2) for overrides the devices or the model cannot take. The run's own mesh where it cannot be
    used (trained on more devices than are here) decodes on one device, said in one line."""
    import jax

    from mtpjax.decode.mesh import check_mesh, fallback_note, mesh_config
    from mtpjax.parallel.sharding import MeshError, make_mesh
    from mtpjax.train.checkpoint import SavedRun

    bad = [o for o in args.mesh_overrides if not o.startswith("mesh.")]
    if bad:
        raise DecodeError(f"{bad[0]!r}: decode.py overrides only the mesh (mesh.data=N, mesh.fsdp=N, mesh.expert=N, "
                          "mesh.tensor=N); the rest of the config is the run's")
    with SavedRun(args.run_dir) as run:
        cfg = mesh_config(run.newest_config(args.step), args.mesh_overrides)
    try:
        mesh = make_mesh(cfg.mesh)
        check_mesh(cfg.model, mesh)
    except MeshError as e:
        if args.mesh_overrides:
            raise
        if note := fallback_note(cfg.model, cfg.mesh, jax.device_count(), str(e)):
            console.say(note)
        return None
    return mesh if mesh.size > 1 else None


def _num_draft(text: str) -> str:
    """--num-draft: `auto` or a chain's length, as decode.draft spells them."""
    if text.strip() != "auto" and not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--num-draft {text} must be auto or an integer number of drafts >= 0")
    return _tree(text)


def _tree(text: str) -> str:
    """--tree: any spelling of decode.draft (checked here, so a bad one is refused before the model loads)."""
    try:
        parse(text)
    except DraftError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.2f}" for k, v in d.items()) + "}"


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        # Bytes of the command line that are not UTF-8 arrive as lone surrogates: make them U+FFFD.
        return [args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")]
    return read_prompts_file(Path(args.prompts_file))


def _proposer(args, cfg) -> str:
    """The proposer a request uses: --proposer, else the draft model if given, else the config's."""
    if args.draft_run_dir is not None:
        if args.proposer not in (None, "model"):
            raise DecodeError(f"--draft-run-dir drafts with --proposer model, not {args.proposer}; drop one of them")
        return "model"
    if (args.proposer or cfg.decode.proposer) == "model":
        said = "--proposer model" if args.proposer else "decode.proposer=model"
        raise DecodeError(f"{said} needs --draft-run-dir RUN (a run trained with the same tokenizer, "
                          "e.g. configs/draft_tiny.yaml)")
    if args.proposer is None and cfg.model.mtp_depth == 0:
        given = draft_flag(args.num_draft, args.tree) or cfg.decode.draft
        if isinstance(given, Tree) and not given.is_chain():
            raise DecodeError(f"the tree {given.name()} is drafted by MTP modules and this run's model has none "
                              "(model.mtp_depth 0); trees need a run trained with model.mtp_depth >= 1")
        return "ngram"  # speculative by default only where the model has a proposer
    return args.proposer or cfg.decode.proposer


def _load_draft(args, tok, run_dir: Path, mesh=None):
    """(draft model, tag) of --draft-run-dir (on the target's mesh), or (None, ""); DecodeError if it tokenizes
    differently."""
    from mtpjax.train.checkpoint import load_model_step

    if args.draft_run_dir is None:
        return None, ""
    _, draft, dtok, dstep = load_model_step(args.draft_run_dir, mesh=mesh)
    if _tokenizer_identity(Path(args.draft_run_dir), dtok) != _tokenizer_identity(run_dir, tok):
        raise DecodeError(f"the draft run '{args.draft_run_dir}' uses another tokenizer than '{run_dir}' ({dtok!r} vs "
                          f"{tok!r}); train the draft with the same data.tokenizer")
    return draft, f" draft {Path(args.draft_run_dir).resolve()} step {dstep}"


def _tokenizer_identity(run_dir: Path, tok) -> tuple:
    """What makes two runs' tokenizers the same: kind, ids, and the bytes of their model files."""
    from mtpjax.data.tokenizer import META_FILE

    d = run_dir / "tokenizer"
    files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != META_FILE}
    return tok.kind, tok.vocab_size, tok.eos_id, files


def decode_config(args, cfg) -> DecodeConfig:
    """The config's decode section with the flags given on the command line laid over it (a flag given wins)."""
    flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
             "top_p": args.top_p, "max_len": args.max_len, "proposer": _proposer(args, cfg),
             "draft": draft_flag(args.num_draft, args.tree)}
    return cfg.decode.model_copy(update={k: v for k, v in flags.items() if v is not None})


class _Streamer:
    """Prints row 0's text as it is committed (host side, once per round): the prompt once its continuation starts
    (a refused request has printed nothing), then the new text; a measurement after it starts on its own line."""

    def __init__(self, tok, prompt: str, stream: bool):
        self.tok, self.prompt, self.stream, self.shown, self.printed, self.ended = tok, prompt, stream, [], "", False

    def echo(self) -> None:
        if self.stream and self.printed == "":
            sys.stdout.write(self.prompt)
            self.printed = self.prompt

    def on_commit(self, toks, counts) -> None:
        self.echo()
        self.shown.extend(toks[0, : int(counts[0])].tolist())
        # A character split across rounds decodes as U+FFFD until its last byte comes: held back, not printed.
        self._print(self.text().rstrip("\ufffd"))

    def text(self) -> str:
        """The prompt and everything committed after it."""
        return self.prompt + self.tok.decode(self.shown)

    def _print(self, text: str) -> None:
        """What `text` adds to what was printed (the printed text is always a prefix of the final text)."""
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text

    def progress(self, text: str) -> None:
        if self.stream and self.printed and not self.ended:
            self._print(self.text())  # the committed text is final once the measurement after it starts
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.ended = True
        console.say(text)

    def finish(self) -> None:
        """The prompt if nothing was committed after it, any text held back, and the line's end unless a measurement
        ended it."""
        self.echo()
        if not self.ended:
            self._print(self.text())
            sys.stdout.write("\n")


def _generate(args, cfg, model, tok, run_dir: Path, step: int, draft=None, draft_tag: str = "") -> int:
    d = decode_config(args, cfg)
    texts = _prompts(args)
    prompts = encode(tok, texts)
    tree = d.draft
    # the most drafts a round may verify (auto: its largest chain or tree)
    most = (max(t.size for t in autodraft.candidates(model, d.proposer, draft)) if isinstance(tree, Auto)
            else tree.size)
    _check_size(cfg.model, prompts, d.max_new_tokens, most, d.max_len)
    out = _Streamer(tok, texts[0], stream=len(prompts) == 1)  # one prompt streams as it decodes; several print at end
    # Kept outside the run directory: decoding never changes a run (it may be shared or read-only).
    on = model.placement.mesh  # a calibration is kept per mesh shape: a round's cost depends on it
    saved = autodraft.SavedCalibrations(args.calibration_file or autodraft.default_calibration_file(),
                                        f"{run_dir.resolve()} step {step}{draft_tag}"
                                        + ("" if on is None else f" mesh {describe(on)}"), refresh=args.recalibrate)
    guess = None  # auto's first choice for a new request shape: the cost model on training's agreement
    if isinstance(tree, Auto) and d.proposer in ("mtp", "mtp1") and cfg.model.mtp_depth:
        guess = agreement_at(run_dir, step, cfg.model.mtp_depth if d.proposer == "mtp" else 1)
    t0 = time.perf_counter()
    res = api.generate(model, prompts, max_new_tokens=d.max_new_tokens, draft=tree, proposer=d.proposer,
                       temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=args.seed, eos_id=tok.eos_id,
                       max_len=d.max_len, on_commit=out.on_commit if out.stream else None, calibrations=saved,
                       draft_model=draft, progress=out.progress, plain_first=True, first_guess=guess)
    seconds = time.perf_counter() - t0
    if out.stream:
        out.finish()
    else:
        for text, toks in zip(texts, res.tokens):
            print(f"### {text!r}\n{text}{tok.decode(toks)}")
    if args.stats:
        _print_stats(res.stats, d.proposer, seconds, saved.path)
    return 0


def label(proposer: str, draft: str) -> str:
    """What ran: `plain` for the empty tree, else the proposer and the tree it drafted (decode.draft's spelling)."""
    return "plain" if parse(draft).size == 0 else f"{proposer} draft={draft}"


def _print_stats(s: dict, proposer: str, seconds: float, saved_path) -> None:
    """--stats: what ran and its acceptance; with auto, what was measured, what it cost, and what was chosen."""
    nodes = f" ({s['drafts']} nodes)" if "acceptance_by_depth_rank" in s else ""  # a tree wider than a chain
    line = f"[{label(proposer, s['draft'])}{nodes}] rounds={s['rounds']} tokens/round={s['tokens_per_round']:.2f}"
    if s["drafts"]:
        if "acceptance_by_depth_rank" in s:  # the share each rank takes at each depth (nn.speed.expected_tokens)
            line += f" acceptance_by_depth_rank={[[round(a, 3) for a in row] for row in s['acceptance_by_depth_rank']]}"
        else:
            line += f" acceptance={[round(a, 3) for a in s['acceptance_by_position']]}"
    print(line, file=sys.stderr)
    if "calibration" in s:
        c = s["calibration"]
        chose = ("plain (no draft count or tree was predicted to beat plain decoding by more than the probe's noise)"
                 if c["drafts"] == 0 else label(proposer, c["draft"]))
        measured = (f"round cost vs plain {_fmt(c['round_cost'])}, expected tokens/round "
                    f"{_fmt(c['expected_tokens'])}")
        if c.get("pruned"):
            measured += f" (timed in the first pass only: {', '.join(map(str, c['pruned']))})"
        if c["source"] == "after":
            print(f"[auto] no measurement for this request shape yet, so {_first(s.get('first_guess'), proposer)}; "
                  f"measured after it (the probe took {c['seconds']:.1f}s, saved in {saved_path}): {measured} -> "
                  f"next time {chose}", file=sys.stderr)
        else:
            how = (f"measurement saved in {saved_path}; --recalibrate measures again" if c["source"] == "saved"
                   else f"measured now: the probe took {c['seconds']:.1f}s of the request's {seconds:.1f}s")
            print(f"[auto] {measured} -> {chose} ({how})", file=sys.stderr)
        if why := verdict.stats_line(c, proposer):
            print(why, file=sys.stderr)


def _first(g: dict | None, proposer: str) -> str:
    """What a request shape's first decode ran (the estimate of mtpjax.decode.firstguess, or plain without one)."""
    if g is None and proposer not in ("mtp", "mtp1"):
        return ("it decoded plain (n-gram lookup and a draft model get no estimate; only the MTP modules' drafts are "
                "estimated, from training's agreement)")
    if g is None:
        return "it decoded plain (the run logged no agreement to estimate from)"
    ran = label(proposer, g["draft"])
    return (f"it ran {ran}, the cost model's choice from training's agreement "
            f"{[round(a, 3) for a in g['alpha_by_position']]} with free verification and drafts at their floor cost "
            f"(round cost {_fmt(g['round_cost'])})")


def _memory_bytes() -> int:
    """Memory of the first device (host RAM on CPU), 0 if unknown."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _check_size(mcfg, prompts, max_new: int, nodes: int, max_len: int) -> None:
    """DecodeError for requests that could only run out of memory (`nodes`: the most drafts a round verifies, each
    bounded by drafts.MAX_NODES where it is spelled)."""
    if max(map(len, prompts)) + max_new > max_len:
        return  # generate() names the cache capacity, the better advice
    need = cache_bytes(mcfg, len(prompts), rows(max(map(len, prompts)), max_new, nodes).capacity)
    have = _memory_bytes()
    if have and need > have // 2:
        raise DecodeError(f"--max-new-tokens {max_new} needs ~{need / 2**30:.1f} GiB of KV cache, more than half of "
                          f"the {have / 2**30:.1f} GiB memory; lower --max-new-tokens")


def _check_eval(args, cfg, model, d: DecodeConfig) -> None:
    """--eval's request refused before it evaluates: its counts, and the checks plain decoding makes of a request
    (generate's, then the memory its caches need: the teacher-forced texts decode together)."""
    counts = (("--eval-batches", args.eval_batches), ("--eval-prompts", args.eval_prompts),
              ("--prompt-len", args.prompt_len))
    for flag, n in counts:
        if n is not None and n < 1:
            raise DecodeError(f"{flag} {n} must be >= 1")
    prompt = [0] * args.prompt_len
    make_loop(model, [prompt], max_new_tokens=d.max_new_tokens, max_len=d.max_len)
    gamma, wider = eval_drafts(cfg, d)
    rows = max(32, args.eval_prompts) if cfg.model.mtp_depth else 1
    _check_size(cfg.model, [prompt] * rows, d.max_new_tokens, max(gamma, wider.size if wider else 0), d.max_len)


@command
def main(argv: list[str] | None = None) -> int:
    """Entry point of decode.py; returns the exit status (2 for bad input, one line on stderr)."""
    p = parser()
    args = p.parse_args(argv)
    if not args.eval and args.prompt is None and args.prompts_file is None and args.tasks is None:
        p.error("give --prompt TEXT, --prompts-file FILE, --eval or --tasks NAMES")
    check_modes(p, args)
    writable("--json", args.json)  # before the run loads: an evaluation's report must have somewhere to go
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)  # orbax's read-only notice is not news to a reader
    from mtpjax.parallel import runtime
    from mtpjax.train.checkpoint import load_model_step

    mesh = _mesh(args)
    cfg, model, tok, step = load_model_step(args.run_dir, args.step, mesh)
    runtime.enable_compilation_cache(cfg.train.compilation_cache)  # under $MTPJAX_CACHE_DIR, not the run
    _proposer(args, cfg)  # flag conflicts before loading a draft
    draft, draft_tag = _load_draft(args, tok, Path(args.run_dir), mesh)
    if mesh is not None:
        console.say(f"decoding on mesh {describe(mesh)}")
    if args.eval:
        d = decode_config(args, cfg)
        _check_eval(args, cfg, model, d)
        return evaluate(args, cfg, model, tok, Path(args.run_dir), step, d, draft)
    if args.tasks is not None:
        from mtpjax.cli.lm_eval import run_tasks

        d = decode_config(args, cfg)
        return run_tasks(args, cfg, model, tok, step, d.proposer, d.draft, draft)
    return _generate(args, cfg, model, tok, Path(args.run_dir), step, draft, draft_tag)
