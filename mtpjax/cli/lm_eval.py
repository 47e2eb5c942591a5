"""`python -m mtpjax lm_eval [lm-eval run arguments]`: lm-eval's own command line, with the `mtpjax` backend
registered and the shipped tasks on its task path.

    python -m mtpjax lm_eval --model mtpjax --model_args run_dir=runs/tiny,num_draft=auto --tasks mtpjax

--include_path DIR (repeated, or several joined with os.pathsep) adds the user's task directories beside the
shipped ones.

model_args: run_dir (required), step, max_length (default data.seq_len), num_draft (an integer or auto) or tree
(decode.py's flags, both spelling decode.draft), proposer (mtp, mtp1, ngram), seed, max_gen_toks; --batch_size is the
rows of one compiled batch.
Importing this module registers the backend, so `lm_eval.simple_evaluate(model="mtpjax", model_args=...)`
works after `import mtpjax.cli.lm_eval`; `load_lm(run_dir)` returns an instance to pass as `model=`.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

from lm_eval.api.registry import register_model

from mtpjax.cli.args import Parser, UsageError, command, draft_flag, write_json
from mtpjax.cli.lm_eval_private import HarnessParsers, harness_parsers
from mtpjax.drafts import PLAIN
from mtpjax.eval import tasks
from mtpjax.eval.harness import BATCH, MtpjaxLM

OPTIONS = ("run_dir", "step", "max_length", "batch_size", "num_draft", "proposer", "tree", "seed", "max_gen_toks")


def load_lm(run_dir, step: int | None = None, *, max_length: int | None = None, batch_size: int = BATCH,
            **options) -> MtpjaxLM:
    """The backend over a run's checkpoint (latest step by default); CheckpointError if it is not a run."""
    from mtpjax.train.checkpoint import load_model_step

    cfg, model, tok, _ = load_model_step(run_dir, step)
    draft = draft_flag(options.pop("num_draft", None), options.pop("tree", None))
    return MtpjaxLM(model, tok, max_length=max_length or cfg.data.seq_len, batch_size=batch_size,
                    proposer=options.pop("proposer", None) or cfg.decode.proposer,
                    draft=PLAIN if draft is None else draft, **options)


def lm_options(given: dict, batch_size=None) -> dict:
    """load_lm's arguments from model_args (and --batch_size); UsageError for an unknown or missing one."""
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise UsageError(f"model_args {', '.join(unknown)} unknown to the mtpjax backend; use {', '.join(OPTIONS)}")
    if "run_dir" not in given:
        raise UsageError("the mtpjax backend needs model_args run_dir=RUN (a run directory written by train.py)")
    out = dict(given)
    if not str(batch_size or "auto").startswith("auto") and "batch_size" not in out:  # auto: the backend's own
        out["batch_size"] = _count("--batch_size", batch_size, 1)
    for key, least in INTEGERS.items():
        if key in out:
            out[key] = _count(f"model_args {key}", out[key], least)
    return out


INTEGERS = {"step": 0, "max_length": 1, "batch_size": 1, "seed": 0, "max_gen_toks": 1}  # each one's least value


def _count(name: str, value, least: int) -> int:
    """`value` (an int, or a string of one) as an int >= least; UsageError naming `name` otherwise."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < least:
        raise UsageError(f"{name}={value} must be an integer >= {least}")
    return int(text)


@register_model("mtpjax")
class RunLM(MtpjaxLM):
    """The registered name: lm-eval builds it from model_args (a run directory) through load_lm."""

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MtpjaxLM:
        return load_lm(**lm_options(arg_dict, (additional_config or {}).get("batch_size")))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MtpjaxLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def _harness_cli() -> HarnessParsers:
    """lm-eval's command line whose parsers report errors as ours do (Parser.error: one UsageError line)."""
    cli = harness_parsers()
    for p in (cli.parser, *cli.commands.values()):
        p.prog = "python -m mtpjax lm_eval" + ("" if p is cli.parser else f" {p.prog.split()[-1]}")
        p.error = functools.partial(Parser.error, p)
    return cli


def check_limit(limit: float | None) -> None:
    """UsageError unless --limit (documents per task, or a fraction below 1), when given, is a number in (0, inf)."""
    if limit is not None and not 0 < limit < math.inf:  # nan and inf reached lm-eval's int(limit), a traceback
        raise UsageError(f"--limit {limit} must be > 0 and finite (documents per task, or a fraction below 1)")


def check_run_args(args, dirs: list[str]) -> None:
    """Before lm-eval starts: the mtpjax backend's run directory and the tasks (the shipped ones, lm-eval's and
    those in the user's directories `dirs`), each problem one line."""
    if args.model == "mtpjax":
        from mtpjax.train.checkpoint import SavedRun

        SavedRun(lm_options(args.model_args or {}, getattr(args, "batch_size", None))["run_dir"]).close()
    if not args.tasks:
        raise UsageError("give --tasks NAMES (the shipped tasks: mtpjax)")
    check_limit(args.limit)
    names = list(args.tasks)
    if dirs:
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=[str(tasks.task_dir()), *dirs])
    else:
        manager = tasks.task_manager(names)
    tasks.load(names, manager)


def include_paths(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without its --include_path options, the user's task directories): the option may repeat and each
    may join several with os.pathsep; lm-eval takes a single directory, so main hands it the list itself."""
    rest, dirs, it = [], [], iter(argv)
    for a in it:
        if a == "--include_path" or a.startswith("--include_path="):
            value = a.partition("=")[2] if "=" in a else next(it, None)
            if not value:
                raise UsageError("--include_path needs a directory of task YAMLs")
            dirs += [d for d in value.split(os.pathsep) if d]
        else:
            rest.append(a)
    for d in dirs:
        if not Path(d).expanduser().is_dir():
            raise UsageError(f"--include_path {d} is not a directory; give a directory of task YAMLs")
    return rest, [str(Path(d).expanduser().absolute()) for d in dirs]


@command
def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's command line (`run` is implied, as in lm-eval) after checking what it is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tasks.go_offline()
    cli = _harness_cli()
    if argv and argv[0] not in cli.commands and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    argv, dirs = include_paths(argv) if argv[:1] == ["run"] else (argv, [])
    args = cli.parser.parse_args(argv)
    if getattr(args, "command", None) == "run":
        if args.model == "mtpjax" and not getattr(args, "batch_size", None) and not getattr(args, "config", None):
            args.batch_size = str(BATCH)  # else lm-eval's own default, 1 row, reaches the backend as if asked
        check_run_args(args, dirs)
        args.include_path = [str(tasks.task_dir()), *dirs]  # the shipped tasks beside the user's
    cli.execute(args)
    return 0


def run_tasks(args, cfg, model, tok, step: int, proposer: str, draft, draft_model=None) -> int:
    """decode.py --tasks: the harness's table, then what speculative generation did on the generation tasks
    (drafting `draft`, the request's mtpjax.drafts Tree or Auto)."""
    from lm_eval.utils import make_table

    from mtpjax.eval.harness import spec_summary

    names = tasks.parse_names(args.tasks)
    check_limit(args.limit)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UsageError(f"--num-fewshot {args.num_fewshot} must be >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be >= 1")
    manager = tasks.task_manager(names)
    tasks.load(names, manager)  # an unknown or unreadable task before anything runs
    lm = MtpjaxLM(model, tok, max_length=cfg.data.seq_len, batch_size=args.batch_size or BATCH, draft=draft,
                  proposer=proposer, seed=args.seed, draft_model=draft_model, measure=True)
    results = tasks.evaluate(lm, names, limit=args.limit, num_fewshot=args.num_fewshot, manager=manager)
    spec = {task: spec_summary(t) for task, t in lm.stats.items()}
    print(f"checkpoint {args.run_dir} step {step}")
    print(make_table(results))
    if spec:
        print(spec_table(spec))
    write_json(args.json, {"run_dir": str(args.run_dir), "step": step, "results": results["results"],
                           "speculative": spec})
    return 0


def spec_table(spec: dict) -> str:
    """The speculative-generation table: per generation task, the draft, tokens/s, tokens per round, acceptance
    by depth and the measured speedup over plain decoding of the same batches; under it, why a task ran plain."""
    rows = ["| task | draft | tokens/s | tokens/round | acceptance by depth | speedup vs plain |",
            "|---|---|---:|---:|---|---:|"]
    for task, s in spec.items():
        acc = "[" + ", ".join(f"{a:.3f}" for a in s["acceptance_by_depth"]) + "]"
        speed = f"{s['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in s else "(plain)"
        rows.append(f"| {task} | {s['draft']} | {s['tokens_per_sec']:.1f} | {s['tokens_per_round']:.2f} | {acc} "
                    f"| {speed} |")
    rows += [f"{task} ran plain: {s['why_plain']}" for task, s in spec.items() if "why_plain" in s]
    return "\n".join(rows)
