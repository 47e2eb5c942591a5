"""`decode.py --eval`: one checkpoint's validation metrics (the training eval's), decoding speed and acceptance."""

from __future__ import annotations

import json
from pathlib import Path

from mtpjax.cli.args import draft_flag
from mtpjax.decode.host import DecodeError
from mtpjax.decode.mesh import describe
from mtpjax.drafts import Tree, chain
from mtpjax.eval import verdict
from mtpjax.parallel import console


def evaluate(args, cfg, model, tok, run_dir: Path, step: int, draft=None) -> int:
    """`decode.py --eval`: the training eval's validation metrics, decode speed per proposer and acceptance on
    held-out text, printed, written as JSON (--json) and into the run's TensorBoard log."""
    from mtpjax.data import first_batches, prepare
    from mtpjax.data.synthetic import task_batch
    from mtpjax.eval.evaluate import agreement_on, forced_acceptance, heldout_prompts, speed_report
    from mtpjax.eval.task_metrics import task_metrics
    from mtpjax.eval.validation import model_metrics, validation_metrics

    n = args.eval_batches if args.eval_batches is not None else (cfg.train.eval_batches or 8)
    if n < 1:
        raise DecodeError(f"--eval-batches {n} must be >= 1")
    console.say("eval: preparing the validation split")
    prepared = prepare(cfg.data)
    batches = first_batches(prepared, n, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                            seed=cfg.train.seed)  # the training eval's batches
    console.say(f"eval: validation metrics on {len(batches)} batches")
    # the training eval's metrics (eval.jsonl at this step, on its first validation batches): one function
    val = validation_metrics(model_metrics(model, batches, step=step, loss_cfg=cfg.loss,
                                           micro_batches=cfg.train.micro_batches), batches, tok)
    # a synthetic source's task metric on its held-out instances (the training eval's eval/task/...)
    val |= task_metrics(model, task_batch(cfg.data, tok, cfg.data.task_instances, cfg.data.seq_len))
    given = draft_flag(args.num_draft, args.tree) or cfg.decode.draft
    tree = given if isinstance(given, Tree) else chain(max(1, cfg.model.mtp_depth))  # auto: the depth
    gamma = tree.size if tree.is_chain() and tree.size else max(1, cfg.model.mtp_depth)
    wider = None if tree.is_chain() else tree
    prompts = heldout_prompts(prepared.val_tokens, args.eval_prompts, args.prompt_len, tok.eos_id)
    max_new = args.max_new_tokens or 128
    console.say(f"eval: decoding {len(prompts)} held-out prompts x {max_new} tokens: plain, n-gram and "
                f"{'the draft model' if draft is not None else 'MTP'} chains of {gamma}"
                f"{f', the tree {wider.name()}' if wider else ''} (compiling, then timing)")
    speed = speed_report(model, prompts, gamma=gamma, max_new=max_new, draft_model=draft, wider=wider)
    if cfg.model.mtp_depth:
        # The held-out text itself as the continuation: acceptance on the distribution training measured.
        texts = heldout_prompts(prepared.val_tokens, max(32, args.eval_prompts), args.prompt_len + max_new, tok.eos_id)
        console.say(f"eval: teacher-forced acceptance on {len(texts)} held-out texts")
        speed["forced_acceptance_by_position"] = forced_acceptance(model, texts, args.prompt_len, gamma)
        speed["agreement_on_heldout"] = agreement_on(model, [t[:args.prompt_len] for t in texts],
                                                     [t[args.prompt_len:] for t in texts], cfg.model.mtp_depth)
    report = {"run_dir": str(run_dir), "step": step, "mesh": describe(model.placement.mesh), "validation": val,
              "decode": speed}
    _print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    _to_tensorboard(run_dir, step, report)
    return 0


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
    of one-point charts would bury the training scalars."""
    from tensorboardX import SummaryWriter

    rows = [f"| val {k} | {v:.4f} |" for k, v in sorted(r["validation"].items())]
    rows += [f"| {k} | {_cell(v)} |" for k, v in r["decode"].items()]
    with SummaryWriter(str(run_dir / "tensorboard")) as w:
        w.add_text("decode_eval", "\n".join(["| metric | value |", "|---|---|", *rows]), step)


def _cell(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
