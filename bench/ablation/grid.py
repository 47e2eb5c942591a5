"""The ablation grid: variants (depth, kind, λ, per-depth curriculum, target) × seeds, each an ordinary run
directory, and the D=0 runs that give the equal-FLOPs comparison.

Every variant of one seed shares `train.seed`, so the trunk, embedding and head start from the same
parameters (the model creates them from `nnx.Rngs(params=seed)` before any MTP module) and the data
iterator yields the same batches; `train.steps` is the same, so they see the same tokens.

Equal FLOPs. Variant v costs F_v training FLOPs per token; D=0 reaches its FLOPs after
N_v = round(steps · F_v / F_0) steps. Read off one longer D=0 run, that point is fair only if the
learning rate at each step does not depend on the run's length:
- `optim.schedule: constant` (warmup, then flat): one D=0 run trained to the largest N_v, evaluated
  exactly at `steps` and at every N_v (it stops and resumes there); its first `steps` steps are the
  equal-tokens D=0 run itself, step for step ("curve" mode).
- a decaying schedule (cosine, linear) anneals to `train.steps`, so D=0 gets one run per distinct N_v,
  each with its own full schedule ("separate" mode: costlier, and still fair).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mtpjax.config import Config, ConfigError, LossConfig, ModelConfig, choices, replace
from mtpjax.nn.flops import train_flops_per_token

KINDS = choices(ModelConfig, "mtp_kind")
SHORT = {"sequential": "seq", "parallel": "par"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.@_-]", "_", text.replace(":", "_"))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One point of the grid (depth 0 has no kind, λ, curriculum or target)."""

    depth: int
    kind: str = "sequential"
    lam: str = ""
    curriculum: str = ""  # loss.mtp_lambda_depths ("" = every depth follows lam)
    target: str = "data"  # loss.mtp_target

    @property
    def name(self) -> str:
        if self.depth == 0:
            return "d0"
        extra = (f"-{_slug(self.curriculum)}" if self.curriculum else "") + \
            (f"-{_slug(self.target)}" if self.target != "data" else "")
        return f"d{self.depth}-{SHORT[self.kind]}-{_slug(self.lam)}{extra}"

    @property
    def label(self) -> str:
        if self.depth == 0:
            return "D=0"
        cur = f" per depth {self.curriculum}" if self.curriculum else ""
        tgt = f" target {self.target}" if self.target != "data" else ""
        return f"D={self.depth} {self.kind} λ={self.lam}{cur}{tgt}"


@dataclasses.dataclass(frozen=True)
class Run:
    """One run directory: a variant trained to `steps`, evaluated on the way at each of `stops`."""

    seed: int
    variant: Variant
    cfg: Config
    stops: tuple[int, ...]  # train.py is called up to each (so each is an eval point); the last is cfg.train.steps

    @property
    def dir(self) -> Path:
        return Path(self.cfg.train.run_dir)

    @property
    def steps(self) -> int:
        return self.cfg.train.steps


def parse_depths(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; ConfigError on anything else."""
    try:
        depths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--depths '{text}' must be comma-separated integers, e.g. 0,1,2") from None
    if not depths or depths[0] < 0:
        raise ConfigError(f"--depths '{text}' must list depths >= 0, e.g. 0,1,2")
    return depths


def parse_kinds(text: str, depths: list[int]) -> dict[str, list[int]]:
    """'sequential,parallel@2' -> {kind: depths > 0 it applies to}; `kind@d+d` restricts a kind to those depths."""
    out: dict[str, list[int]] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        kind, _, only = item.partition("@")
        if kind not in KINDS:
            raise ConfigError(f"--kinds: unknown kind '{kind}'; use {' or '.join(KINDS)}, optionally @depths "
                              "(e.g. parallel@2)")
        try:
            ds = [int(d) for d in only.split("+")] if only else [d for d in depths if d > 0]
        except ValueError:
            raise ConfigError(f"--kinds '{item}': depths after @ must be integers joined by +, e.g. parallel@1+2") \
                from None
        missing = [d for d in ds if d not in depths or d == 0]
        if missing:
            raise ConfigError(f"--kinds '{item}': depth {missing[0]} is not one of the MTP depths in --depths")
        out[kind] = ds
    if not out:
        raise ConfigError("--kinds is empty; use sequential, parallel or both")
    return out


def parse_targets(items: list[str], depths: list[int]) -> dict[str, list[int]]:
    """['tv@1', 'mix:self=0.5,tv=0.5'] -> {target: MTP depths it is trained at}; no @ = every MTP depth."""
    out: dict[str, list[int]] = {}
    for item in items:
        target, _, only = item.rpartition("@") if "@" in item else (item, "", "")
        try:
            ds = [int(d) for d in only.split("+")] if only else [d for d in depths if d > 0]
        except ValueError:
            raise ConfigError(f"--target '{item}': depths after @ must be integers joined by +, e.g. tv@1+2") from None
        missing = [d for d in ds if d not in depths or d == 0]
        if missing:
            raise ConfigError(f"--target '{item}': depth {missing[0]} is not one of the MTP depths in --depths")
        LossConfig(mtp_target=target)  # ConfigError naming loss.mtp_target
        out[target] = ds
    return out


def variants(depths: list[int], kinds: dict[str, list[int]], lambdas: list[str], curricula: list[str] = (),
             targets: dict[str, list[int]] | None = None) -> list[Variant]:
    """D=0 first (if asked), then per MTP depth: every (kind, λ), the same under each curriculum, then every (kind, λ)
    with each extra target at the depths it names (without a curriculum; the others train on the data target)."""
    out = [Variant(0)] if 0 in depths else []
    for d in (d for d in depths if d > 0):
        base = [(k, lam) for k, ds in kinds.items() if d in ds for lam in lambdas]
        out += [Variant(d, k, lam, cur) for cur in ["", *curricula] for k, lam in base]
        out += [Variant(d, k, lam, "", t) for t, ds in (targets or {}).items() if d in ds for k, lam in base]
    return out


def variant_config(base: Config, v: Variant, seed: int, steps: int, run_dir: Path) -> Config:
    """The base config with this variant's model/loss settings, seed, length and run directory."""
    over = [f"model.mtp_depth={v.depth}", f"train.seed={seed}", f"train.steps={steps}", f"train.run_dir={run_dir}"]
    if v.depth:
        over += [f"model.mtp_kind={v.kind}", f"loss.mtp_lambda={v.lam}", f"loss.mtp_lambda_depths={v.curriculum}",
                 f"loss.mtp_target={v.target}"]
    return replace(base, over)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of one step of a run (trunk, MTP modules and their unrolled reuses, every head
    application; 3 × forward). Not counted: `self` and `tv` targets recompute the main head's logits on the shifted
    trunk states inside each loss chunk (forward only, under stop_gradient): 2·d·V more FLOPs a token per depth."""
    return train_flops_per_token(cfg.model, cfg.data.seq_len, unroll=cfg.loss.mtp_unroll)


def step_flops(cfg: Config, step: int) -> float:
    """Training FLOPs the compiled step spends at `step`. A depth whose λ is 0 at that step (before a forward
    curriculum switches it on, after a reverse one switches it off) is still computed inside the one jitted step
    (tests/test_objectives.py compiles both and compares XLA's counts), so it is charged like any other: the
    count is the same at every step of any λ schedule."""
    del step  # the compiled step does not depend on it (see above)
    return cfg.train.batch_size * cfg.data.seq_len * flops_per_token(cfg)


def flops_spent(cfg: Config, steps: int) -> float:
    """Training FLOPs spent over the first `steps` steps: step_flops integrated over the λ schedule."""
    return sum(step_flops(cfg, s) for s in range(steps))


def mode(base: Config) -> str:
    """'curve' (one D=0 run read at every FLOP point) when the lr does not depend on the run length."""
    return "curve" if base.optim.schedule == "constant" else "separate"


def equal_flops_steps(base: Config, vs: list[Variant], steps: int) -> dict[str, int]:
    """Variant name -> steps of D=0 with the same training FLOPs as `steps` steps of that variant (its FLOPs
    integrated over its λ schedule, divided by D=0's FLOPs per step)."""
    d0 = replace(base, ["model.mtp_depth=0", f"train.steps={steps}"])
    out = {}
    for v in vs:
        if v.depth:
            cfg = variant_config(base, v, base.train.seed, steps, Path(base.train.run_dir))
            out[v.name] = round(flops_spent(cfg, steps) / step_flops(d0, 0))
    return out


def plan_runs(base: Config, vs: list[Variant], seeds: list[int], steps: int, out: Path) -> list[Run]:
    """Every run of the sweep, in the order it trains: per seed, D=0 (and its equal-FLOPs runs), then the rest."""
    targets = sorted(set(equal_flops_steps(base, vs, steps).values()) - {steps})
    runs = []
    for s in seeds:
        for v in vs:
            if v.depth:
                runs.append(Run(s, v, variant_config(base, v, s, steps, out / f"seed{s}" / v.name), (steps,)))
                continue
            if mode(base) == "curve":
                last = max([steps, *targets])
                cfg = variant_config(base, v, s, last, out / f"seed{s}" / v.name)
                runs.append(Run(s, v, cfg, tuple(sorted({steps, *targets}))))
            else:
                runs.append(Run(s, v, variant_config(base, v, s, steps, out / f"seed{s}" / v.name), (steps,)))
                for n in targets:
                    cfg = variant_config(base, v, s, n, out / f"seed{s}" / f"d0-steps{n}")
                    runs.append(Run(s, v, cfg, (n,)))
    return runs


def d0_run_at(runs: list[Run], seed: int, step: int) -> Run:
    """The D=0 run of `seed` whose eval curve holds the properly scheduled point at `step`."""
    for r in runs:
        if r.seed == seed and r.variant.depth == 0 and step in r.stops:
            return r
    raise KeyError((seed, step))
