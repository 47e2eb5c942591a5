"""What a run tells its user: the opening banner, per-step metrics (TensorBoard, progress bar), the summary."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import jax
from flax import nnx

from mtpjax.config import Config
from mtpjax.parallel import console, distributed
from mtpjax.nn.flops import train_flops_per_token
from mtpjax.train import goodput
from mtpjax.train.metrics import Writer, mfu
from mtpjax.nn.model import build_model, param_counts

NEXT_PROMPT = "def fibonacci(n):"  # the prompt of the decode command the summary suggests
# Sampled, not greedy: a young model's greedy text repeats one line. decode.py's default decode.draft (auto) drafts
# from the first call on (its estimate from the run's own agreement), then measures what this machine prefers.
NEXT_SAMPLING = ("--temperature", "0.7", "--top-k", "40")


def say(text: str) -> None:
    """A line on stderr from process 0 (above the progress bar)."""
    if distributed.is_primary():
        console.say(text)


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def _count(n, what: str) -> str:
    return f"? {what}s" if n is None else f"{n} {what}" + ("" if n == 1 else "s")


def banner(cfg: Config, mesh, run: Path, start: int, prepared, eval_batches: int) -> str:
    """Parameters, devices and mesh, run dir (resumed or fresh), data, and the plan of steps (`eval_batches`: how
    many the validation split gave): several lines."""
    pc = param_counts(nnx.eval_shape(lambda: build_model(cfg)))
    mtp = f", {_count(len(pc['mtp']), 'MTP module')} x {_millions(pc['mtp'][0])}" if pc["mtp"] else ", no MTP modules"
    dev = jax.devices()
    t, d = cfg.train, cfg.data
    parts = [p for _, _, p in prepared.sources()]  # one for a corpus, several for a data.mixture
    what = d.source if len(parts) == 1 else f"mixture of {len(parts)} sources"
    files = None if any(p.meta.get("files") is None for p in parts) else sum(p.meta["files"] for p in parts)
    return "\n".join([
        f"mtpjax train: {_millions(pc['total'])} parameters (trunk {_millions(pc['trunk'])}, embedding/head "
        f"{_millions(pc['shared_embed_head'])}{mtp})",
        f"  devices: {len(dev)} x {dev[0].device_kind} on {jax.process_count()} process(es); mesh "
        + " ".join(f"{k}={v}" for k, v in mesh.shape.items()),
        f"  run dir: {run} ({f'resuming from step {start}' if start else 'fresh start'})",
        f"  data: {what} ({_count(files, 'file')}), {sum(len(p.train_tokens) for p in parts):,} train / "
        f"{sum(len(p.val_tokens) for p in parts):,} val tokens, {d.tokenizer} tokenizer "
        f"(vocab {prepared.tokenizer.vocab_size}), content {str(prepared.content_hash)[:12]}",
        f"  steps {start} -> {t.steps}: batch {t.batch_size} x {d.seq_len} tokens, {_evals(t, eval_batches)}, "
        f"checkpoint every {cfg.checkpoint.every}",
    ])


def _evals(t, got: int) -> str:
    """The banner's eval plan; `got`: the validation batches, fewer than train.eval_batches if the split is short."""
    if not t.eval_batches:
        return "no eval (train.eval_batches=0)"
    short = f" (the whole validation split; train.eval_batches={t.eval_batches} asks more)"
    return f"eval every {t.eval_every} on {got} batch{'' if got == 1 else 'es'}{short if got < t.eval_batches else ''}"


def decode_command(run: Path) -> str:
    """The command that decodes from this run (what the summary suggests next)."""
    return (f"python decode.py --run-dir {shlex.quote(str(run))} --prompt {shlex.quote(NEXT_PROMPT)} "
            f"{' '.join(NEXT_SAMPLING)} --stats")


def summary(cfg: Config, run: Path, out: dict, checkpoint: Path | None) -> str:
    """Final losses, where the last checkpoint is, and the next command: several lines."""
    depth = cfg.model.mtp_depth
    why = "interrupted" if out.get("interrupted") else "preempted" if out["preempted"] else "stopped"
    done = f"{why} at step {out['step']}"
    if out["step"] >= cfg.train.steps:
        done = f"done: {out['step']} steps"
    lines = [f"{done} of {cfg.train.steps} in {out['seconds']:.0f} s"
             + (f", {out['skipped_steps']} non-finite updates skipped" if out["skipped_steps"] else "")
             + (f"; {goodput.line(out['goodput_s'])}" if "goodput_s" in out else "")]
    if out["step"] > cfg.train.steps:  # resumed past its end: a shortened train.steps trains nothing
        lines[0] = (f"nothing trained: the run is at step {out['step']}, past train.steps={cfg.train.steps} (raise it "
                    "to train on)")
    for prefix, name in (("", "train"), ("eval/", "eval")):
        losses = [(k, out.get(f"{prefix}loss/{k}")) for k in ["main"] + [f"mtp_{i}" for i in range(1, depth + 1)]]
        if losses[0][1] is not None:
            lines.append(f"  {name} loss: " + ", ".join(f"{k} {v:.4f}" for k, v in losses if v is not None))
    lines.append(f"  checkpoint: {checkpoint}" if checkpoint else "  checkpoint: none")
    if out["step"] < cfg.train.steps:
        lines.append("  resume: run the same command again")
    if checkpoint:  # nothing saved: nothing to decode
        lines.append(f"  next: {decode_command(run)}")
    return "\n".join(lines)


class Logger:
    """Consumes each step's fetched metrics: history, TensorBoard every log_every steps, progress bar, tokens/s."""

    def __init__(self, cfg: Config, writer: Writer, bar, n_devices: int, peak: float, lines: bool = False):
        self.cfg, self.writer, self.bar, self.lines = cfg, writer, bar, lines  # lines: a line per logged step
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self.flops = train_flops_per_token(cfg.model, cfg.data.seq_len, frozen_trunk=cfg.train.freeze == "trunk",
                                           unroll=cfg.loss.mtp_unroll)
        self.n_devices, self.peak = n_devices, peak
        self.history, self.last = [], {}
        self.t0, self.s0 = None, None

    def restart_clock(self, step: int, t: float | None = None) -> None:
        """Exclude compilation, eval and checkpoint time from tokens/s: the rate counts from step `step` queued at host
        time `t`; without `t` (after an eval or a save) from the next step recorded."""
        self.t0, self.s0 = t, step

    def due(self, step: int) -> bool:
        """Whether `step` is logged: every train.log_every-th, and the run's last (the step its summary reports)."""
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps

    def record(self, step: int, met: dict, t: float | None = None) -> None:
        """One applied step's metrics (host floats); `t`: when the host queued it (default now). The reader runs a
        step behind, so that is when the step before was done, whether the step is read at the next tick or at once
        (an eval's or a save's tick): the rate is steps over the time between two queueings."""
        t = time.perf_counter() if t is None else t
        self.last = met
        self.history.append((step, met["loss/total"]))
        losses = {k: v for k, v in met.items() if k not in ("loss/total", "skipped")}
        if self.t0 is None:  # the first step of a process or after an eval or save: its losses, no throughput
            self.restart_clock(step, t)
            if self.due(step):
                self.writer.scalars(step, losses)
                self._line(step, met, {})
        elif self.due(step) and step > self.s0:
            tps = (step - self.s0) * self.tokens_per_step / (t - self.t0)
            extra = {"tokens_per_sec": tps, "mfu": mfu(tps, self.flops, self.peak, self.n_devices)}
            self.writer.scalars(step, losses | extra)
            self.bar.set_postfix(loss=f"{met['loss/main']:.3f}", tok_s=f"{tps:,.0f}")
            self._line(step, met, extra)
            self.restart_clock(step, t)

    def _line(self, step: int, met: dict, extra: dict) -> None:
        """Where no bar redraws (piped to a log file, or train.progress=false): the logged step as one line."""
        if not self.lines:
            return
        parts = [f"mtp_{k} {met[f'loss/mtp_{k}']:.4f}" for k in range(1, self.cfg.model.mtp_depth + 1)
                 if f"loss/mtp_{k}" in met] + [f"{k} {met[k]:.3g}" for k in ("lr", "grad_norm") if k in met]
        if extra:
            parts += [f"{extra['tokens_per_sec']:,.0f} tokens/s", f"mfu {extra['mfu']:.1%}"]
        say(f"step {step}: loss/main {met['loss/main']:.4f}" + "".join(f", {p}" for p in parts))
