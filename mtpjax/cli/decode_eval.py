"""`decode.py --eval`: one checkpoint's validation metrics (the training eval's), decoding speed and acceptance."""

from __future__ import annotations

from pathlib import Path

from mtpjax.cli.args import write_json
from mtpjax.config import DecodeConfig
from mtpjax.decode.host import DecodeError
from mtpjax.decode.mesh import describe
from mtpjax.drafts import Tree, chain
from mtpjax.errors import first_line
from mtpjax.eval import verdict
from mtpjax.parallel import console


def eval_drafts(cfg, d: DecodeConfig) -> tuple[int, Tree | None]:
    """(γ of the chains --eval times, the tree it times beside them or None) for the decode section `d`: a chain as
    given, else the MTP modules' depth (auto, plain), and a tree as given."""
    tree = d.draft if isinstance(d.draft, Tree) else chain(max(1, cfg.model.mtp_depth))  # auto: the depth
    gamma = tree.size if tree.is_chain() and tree.size else max(1, cfg.model.mtp_depth)
    return gamma, None if tree.is_chain() else tree


def evaluate(args, cfg, model, tok, run_dir: Path, step: int, d: DecodeConfig, draft=None) -> int:
    """`decode.py --eval`: the training eval's validation metrics, decode speed per proposer and acceptance on
    held-out text, printed, written as JSON (--json) and, where it can be, into the run's TensorBoard log."""
    from mtpjax.data import first_batches, prepare
    from mtpjax.data.synthetic import task_batch
    from mtpjax.eval.evaluate import agreement_on, forced_acceptance, speed_report
    from mtpjax.eval.task_metrics import task_metrics
    from mtpjax.eval.validation import model_metrics, validation_metrics

    n = args.eval_batches if args.eval_batches is not None else (cfg.train.eval_batches or 8)
    console.say("eval: preparing the validation split")
    prepared = prepare(cfg.data)
    max_new, L = d.max_new_tokens, args.prompt_len
    prompts = _heldout(prepared, args.eval_prompts, L, tok, f"--prompt-len {L}", "--prompt-len")
    if cfg.model.mtp_depth:  # the held-out text itself as the continuation, for teacher-forced acceptance
        texts = _heldout(prepared, max(32, args.eval_prompts), L + max_new, tok,
                         f"--prompt-len {L} + --max-new-tokens {max_new}", "--prompt-len or --max-new-tokens")
    batches = first_batches(prepared, n, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                            seed=cfg.train.seed)  # the training eval's batches
    console.say(f"eval: validation metrics on {len(batches)} batches")
    # the training eval's metrics (eval.jsonl at this step, on its first validation batches): one function
    val = validation_metrics(model_metrics(model, batches, step=step, loss_cfg=cfg.loss,
                                           micro_batches=cfg.train.micro_batches), batches, tok)
    # a synthetic source's task metric on its held-out instances (the training eval's eval/task/...)
    val |= task_metrics(model, task_batch(cfg.data, tok, cfg.data.task_instances, cfg.data.seq_len))
    gamma, wider = eval_drafts(cfg, d)
    console.say(f"eval: decoding {len(prompts)} held-out prompts x {max_new} tokens: plain, n-gram and "
                f"{'the draft model' if draft is not None else 'MTP'} chains of {gamma}"
                f"{f', the tree {wider.name()}' if wider else ''} (compiling, then timing)")
    speed = speed_report(model, prompts, gamma=gamma, max_new=max_new, draft_model=draft, wider=wider)
    if cfg.model.mtp_depth:
        # acceptance on the distribution training measured
        console.say(f"eval: teacher-forced acceptance on {len(texts)} held-out texts")
        speed["forced_acceptance_by_position"] = forced_acceptance(model, texts, L, gamma)
        speed["agreement_on_heldout"] = agreement_on(model, [t[:L] for t in texts], [t[L:] for t in texts],
                                                     cfg.model.mtp_depth)
    report = {"run_dir": str(run_dir), "step": step, "mesh": describe(model.placement.mesh), "validation": val,
              "decode": speed}
    _print_report(report)
    write_json(args.json, report)
    _to_tensorboard(run_dir, step, report)
    return 0


def _heldout(prepared, n: int, length: int, tok, what: str, lower: str) -> list[list[int]]:
    """n held-out sequences of `length` tokens (fewer where the split has fewer); DecodeError when it has none."""
    from mtpjax.eval.evaluate import heldout_prompts

    out = heldout_prompts(prepared.val_tokens, n, length, tok.eos_id)
    if not out:
        raise DecodeError(f"the validation split has no stretch of {what} tokens without an end of text "
                          f"to decode from; lower {lower}")
    return out


def _print_report(r: dict) -> None:
    print(f"checkpoint {r['run_dir']} step {r['step']} on {r['mesh']}")
    print(f"{'metric':<34}{'value':>12}")
    for k, v in sorted(r["validation"].items()):
        print(f"  val {k:<30}{v:>12.4f}")
    for k, v in r["decode"].items():
        if isinstance(v, list):
            v = "[" + ", ".join(f"{x:.3f}" for x in v) + "]"
            print(f"  {k:<32}{v:>12}")
        elif isinstance(v, float):
            print(f"  {k:<32}{v:>12.3f}")
        else:
            print(f"  {k:<32}{v!s:>12}")
    for line in (verdict.eval_line(r["decode"]), verdict.eval_line(r["decode"], "model_", "the draft model")):
        if line:
            print(line)


def _to_tensorboard(run_dir: Path, step: int, r: dict) -> None:
    """The report as one text table in the run's TensorBoard log (Text tab): one evaluation is no curve, and dozens
    of one-point charts would bury the training scalars. A run dir it cannot write (read-only, shared) is a warning:
    the report is out already."""
    from tensorboardX import SummaryWriter

    rows = [f"| val {k} | {v:.4f} |" for k, v in sorted(r["validation"].items())]
    rows += [f"| {k} | {_cell(v)} |" for k, v in r["decode"].items()]
    try:
        with SummaryWriter(str(run_dir / "tensorboard")) as w:
            w.add_text("decode_eval", "\n".join(["| metric | value |", "|---|---|", *rows]), step)
    except OSError as e:
        console.say(f"warning: the report is not in the run's TensorBoard log ({first_line(e)}); it was printed "
                    "above (and written to --json if given)")


def _cell(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
