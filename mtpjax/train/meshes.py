"""The meshes `python -m mtpjax compile` puts a config on: one that fills a target when the config's mesh does not
match it, and the candidates `--search` compiles and ranks (data / fsdp / expert / tensor, micro-batches)."""

from __future__ import annotations

import math

from mtpjax.config import Config, MeshConfig
from mtpjax.parallel.sharding import AXES, STAGE, MeshError

# Tensor parallelism stays inside one host's fast links (NVLink, a TPU host's ICI neighbours): at most 8 ways.
MAX_TENSOR = 8


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def usable(cfg: Config, mesh: MeshConfig, micro_batches: int) -> bool:
    """Whether the run could take this mesh and micro-batches: tensor divides the heads, expert the routed experts,
    and the batch splits over the batch shards and micro-batches (what train.py and compile refuse otherwise)."""
    m = cfg.model
    if m.n_heads % mesh.tensor or mesh.tensor > MAX_TENSOR:
        return False
    if mesh.expert > 1 and (m.mlp_kind != "moe" or m.n_routed_experts % mesh.expert):
        return False
    return cfg.train.batch_size % (mesh.data * mesh.fsdp * mesh.expert * micro_batches) == 0


def _stages(cfg: Config, devices: int) -> int:
    """The config's pipeline stages, which every mesh over `devices` keeps; MeshError if they do not divide them."""
    if devices % cfg.mesh.stage:
        raise MeshError(f"mesh.stage={cfg.mesh.stage} does not divide the target's {devices} devices; choose "
                        "another mesh.stage or target")
    return cfg.mesh.stage


def fills(cfg: Config, devices: int) -> MeshConfig:
    """A mesh over all `devices` at the config's micro-batches: the config's stage, tensor and expert ways with the
    rest fully sharded (fsdp) where the run can take it, else the first candidate that can (more tensor or expert
    ways)."""
    m, A = cfg.mesh, cfg.train.micro_batches
    stage = _stages(cfg, devices)
    tensor = m.tensor if (devices // stage) % m.tensor == 0 else 1
    expert = m.expert if (devices // (stage * tensor)) % m.expert == 0 else 1
    own = MeshConfig(data=1, fsdp=devices // (stage * tensor * expert), tensor=tensor, expert=expert, stage=stage)
    if usable(cfg, own, A):
        return own
    return next((mesh for mesh, a in candidates(cfg, devices, limit=None) if a == A), own)  # own: refused later


def candidates(cfg: Config, devices: int, limit: int | None) -> list[tuple[MeshConfig, int]]:
    """Up to `limit` (mesh, micro-batches) pairs over all `devices` the run could take, most promising first: the
    most expert ways (an MoE), the config's micro-batches, then the fewest tensor and data ways (their collectives
    move activations or whole gradients). The config's pipeline stages stay."""
    moe, A = cfg.model.mlp_kind == "moe", cfg.train.micro_batches
    stage = _stages(cfg, devices)
    micro = sorted({A, max(1, A // 2), 2 * A}, key=lambda a: (a != A, a))
    found, rest = [], devices // stage
    for tensor in _divisors(rest):
        for expert in (_divisors(rest // tensor) if moe else [1]):
            for data in _divisors(rest // (tensor * expert)):
                fsdp = rest // (tensor * expert * data)
                mesh = MeshConfig(data=data, fsdp=fsdp, tensor=tensor, expert=expert, stage=stage)
                for a in micro:
                    if usable(cfg, mesh, a):
                        # expert-parallel first for an MoE (its experts' weights never move); the config's
                        # micro-batches before others, so the meshes differ first; then the fewest tensor and data ways
                        found.append(((-expert, micro.index(a), tensor * data, data), mesh, a))
    found.sort(key=lambda f: f[0])
    return [(mesh, a) for _, mesh, a in found[:limit]]


def overrides(mesh: MeshConfig, micro_batches: int | None = None) -> list[str]:
    """The `section.key=value` overrides that choose this mesh (and micro-batches)."""
    out = [f"mesh.{a}={getattr(mesh, a)}" for a in (STAGE, *AXES) if a != STAGE or mesh.stage > 1]
    return out + ([f"train.micro_batches={micro_batches}"] if micro_batches is not None else [])


def describe(mesh: MeshConfig) -> str:
    """'fsdp 4 x tensor 2': the axes of more than one device (one device: 'one device')."""
    parts = [f"{a} {getattr(mesh, a)}" for a in (STAGE, *AXES) if getattr(mesh, a) > 1]
    return " x ".join(parts) or "one device"


def size(mesh: MeshConfig) -> int:
    """Devices the mesh spans (pipeline stages included)."""
    return math.prod(getattr(mesh, a) for a in (STAGE, *AXES))


def search(cfg: Config, target, limit: int, place=None) -> list[dict]:
    """Each candidate's train step compiled for `target`: its mesh, micro-batches, memory per device and, for those
    that fit, the roofline estimate; ranked fastest first, those that do not fit last. `place(overrides)` gives the
    config a candidate's overrides make."""
    from mtpjax.errors import MtpjaxError
    from mtpjax.parallel.targets import TargetError
    from mtpjax.train.aot import DoesNotFit, compile_report  # the compilers load with it: only when searching

    rows = []
    for mesh, a in candidates(cfg, target.devices, limit):
        row = {"mesh": describe(mesh), "micro_batches": a, "overrides": overrides(mesh, a)}
        try:
            report = compile_report(place(row["overrides"]), target, decode=False, eval_step=False)
            p = report["programs"][0]
            r = p["roofline"]
            row.update(memory=p["memory"]["total"], fits=True, estimate_s=r["estimate_s"], bound=r["bound"],
                       mfu=p["mfu_estimate"], collective_fraction=p["collective_fraction"],
                       tokens_per_s=report["tokens_per_step"] / r["estimate_s"])
        except DoesNotFit as e:
            row.update(fits=False, why=str(e).split(";")[0])
        except TargetError:  # the target's compiler is missing: no candidate can compile, so the search stops
            raise
        except MtpjaxError as e:  # a candidate the compiler or the run refuses: said, not fatal to the search
            row.update(fits=False, why=str(e))
        rows.append(row)
    return sorted(rows, key=lambda r: (not r["fits"], r.get("estimate_s", 0.0)))


def ranking(rows: list[dict], target_name: str) -> str:
    """The search's table, fastest first."""
    lines = [f"mesh search on {target_name} (train step only; roofline ESTIMATES from published peaks):",
             f"  {'rank':<5}{'mesh':<32}{'micro':>6}{'GiB/device':>12}{'ms/step':>10}  {'bound':<11}{'MFU':>7}"
             f"{'tokens/s':>11}{'coll.':>7}"]
    for i, r in enumerate(rows, 1):
        if not r["fits"]:
            lines.append(f"  {'-':<5}{r['mesh']:<32}{r['micro_batches']:>6}  {r['why']}")
            continue
        lines.append(f"  {i:<5}{r['mesh']:<32}{r['micro_batches']:>6}{r['memory'] / 2**30:>12.2f}"
                     f"{r['estimate_s'] * 1e3:>10.3g}  {r['bound']:<11}{r['mfu']:>7.1%}{r['tokens_per_s']:>11.3g}"
                     f"{r['collective_fraction']:>7.1%}")
    best = next((r for r in rows if r["fits"]), None)
    lines.append(f"best: {' '.join(best['overrides'])}" if best else "no candidate fits: try model.remat=full or "
                 "a larger target")
    return "\n".join(lines)
