"""Runs in a subprocess with 4 simulated CPU devices: the decode loop on meshes against one device (the same process).

argv: <in.json> <out.json>. Writes, per mesh × proposer case, the sharded and the one-device greedy tokens, the
layouts the caches really got (and with a layout that splits a cache's positions instead: "wrong-axis"), the tokens
of a data-parallel verification reading the other shard's rows, the log lines of the fallbacks, the caches after
rejections against a fresh prefill on the mesh, and the sampled-distribution check on tensor=2.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import (ALL_SCHEMES, PROMPTS, _cfg, _check_target_distribution, _fresh_module_caches,  # noqa: E402
                              _sharpen, _train)

import mtpjax.decode.loop as loop_mod  # noqa: E402
import mtpjax.decode.mesh as mesh_mod  # noqa: E402
from mtpjax.config import MeshConfig  # noqa: E402
from mtpjax.decode.host import make_loop, run, summarize  # noqa: E402
from mtpjax.decode.mesh import on_mesh  # noqa: E402
from mtpjax.decode.sampling import make_sampler  # noqa: E402
from mtpjax.nn.model import build_model  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402

MLA_MOE = dict(attention_kind="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               mlp_kind="moe", n_routed_experts=4, num_experts_per_tok=2, moe_d_ff=32, first_k_dense_replace=1)
# (name, model, mesh axes, request): each rule of decode.mesh by one case, not the whole product
CASES = [
    ("gqa-tensor2-mtp", "gqa", dict(tensor=2), dict(draft=3)),
    ("gqa-data2-tree", "gqa", dict(data=2), dict(draft="2x2")),
    ("mla-moe-expert2-mtp", "mla", dict(expert=2), dict(draft=2)),
    ("mla-moe-tensor2-hybrid", "mla", dict(tensor=2), dict(draft="2x2+ngram2")),
    ("mla-moe-data2-ngram", "mla", dict(data=2), dict(draft=2, proposer="ngram")),
    ("gqa-data2-tensor2-draft", "gqa", dict(data=2, tensor=2), dict(draft=2, proposer="model", prompts=3)),
]
MAX_NEW = 16


def mesh_of(axes: dict):
    n = int(np.prod(list(axes.values())))
    return make_mesh(MeshConfig(**axes), jax.devices()[:n])


def decode(model, prompts, draft_model=None, sampler=None, **kw):
    """(tokens, stats, final state) of one generation."""
    loop = make_loop(model, prompts, max_new_tokens=MAX_NEW, sampler=sampler or make_sampler(),
                     draft_model=draft_model, **kw)
    st = run(model, prompts, loop, draft_model=draft_model)
    res = summarize(st, loop.tree)
    return res.tokens, res.stats, st


def layouts(st) -> dict:
    """Spec and first addressable shard's shape of the first trunk layer's and first MTP module's cache arrays."""
    out = {}
    caches = {"trunk": st.trunk[0]}
    if hasattr(st.proposer, "caches"):
        caches["module"] = st.proposer.caches[0]
    for name, kv in caches.items():
        for field, x in zip(kv._fields, kv):
            out[f"{name}.{field}"] = {"spec": [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
                                      + [None] * (x.ndim - len(x.sharding.spec)),
                                      "global": list(x.shape), "shard": list(x.addressable_shards[0].data.shape)}
    out["seq_BS"] = {"shard": list(st.seq_BS.addressable_shards[0].data.shape), "global": list(st.seq_BS.shape)}
    return out


def wrong_axis_specs(placement, tree, batch):
    """A layout that splits each GQA cache's positions over `tensor` instead of its kv heads."""
    out = REAL_SPECS(placement, tree, batch)
    fix = lambda s: type(s)(*s[:-3], s[-2], s[-3], s[-1]) if len(s) >= 4 else s  # noqa: E731
    return jax.tree.map(lambda s, x: fix(s) if x.ndim >= 4 else s, out, tree,
                        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


REAL_SPECS = mesh_mod.specs


def models():
    """Briefly trained target models (drafts both accepted and rejected) and a draft model with one kv head."""
    out = {}
    for name, kw, seed in (("gqa", {}, 0), ("mla", MLA_MOE, 1), ("draft", dict(n_kv_heads=1, n_layers=1), 2)):
        cfg = _cfg(**kw)
        out[name] = build_model(cfg, seed=seed)
        _train(out[name], cfg, steps=4)
    return out


def cases(ms: dict, out: dict) -> None:
    for name, model, axes, req in CASES:
        req = dict(req)
        prompts = PROMPTS[: req.pop("prompts", len(PROMPTS))]
        mesh = mesh_of(axes)
        draft = ms["draft"] if req.get("proposer") == "model" else None
        one, stats, _ = decode(ms[model], prompts, draft_model=draft, **req)
        sharded = on_mesh(ms[model], mesh)
        sdraft = None if draft is None else on_mesh(draft, mesh)
        toks, _, st = decode(sharded, prompts, draft_model=sdraft, **req)
        out["cases"][name] = {"one": one, "mesh": toks, "layouts": layouts(st), "accepted": sum(stats["accepted"]),
                              "reached": sum(stats["reached"])}
        if name == "gqa-tensor2-mtp":
            out["wrong-axis"] = layouts(patched(mesh_mod, "specs", wrong_axis_specs, sharded, prompts, req)[2])
        if name == "gqa-data2-tree":  # companion: each data shard verifies the other shard's rows
            other = functools.partial(rolled, loop_mod.take_rows, len(prompts) // 2)
            out["other-rows"] = patched(loop_mod, "take_rows", other, sharded, prompts, req)[0]


def rolled(take_rows, shift: int, x, i):
    """take_rows whose row b is row b - shift's: with shift = B/2 on data=2, the other shard's rows."""
    return jnp.roll(take_rows(x, i), shift, axis=0)


def patched(module, name: str, value, model, prompts, req):
    """decode() with module.name replaced by value, compiled anew."""
    real = getattr(module, name)
    setattr(module, name, value)
    jax.clear_caches()
    try:
        return decode(model, prompts, **req)
    finally:
        setattr(module, name, real)
        jax.clear_caches()


def caches_after_rejections(model) -> dict:
    """tensor=2, sampled MTP drafting: committed cache entries against a fresh prefill on the mesh (max differences)."""
    sharded = on_mesh(model, mesh_of(dict(tensor=2)))
    _, stats, st = decode(sharded, PROMPTS, draft=3)
    seq, n_B = np.asarray(st.seq_BS), np.asarray(st.n_B)
    worst = 0.0
    for b in range(len(PROMPTS)):
        n = int(n_B[b])
        trunk, mods = _fresh_module_caches(sharded, jnp.asarray(seq[b]), n)
        pairs = [(got, want, n - 1) for got, want in zip(st.trunk, trunk)]
        pairs += [(got, want, n - k) for k, (got, want) in enumerate(zip(st.proposer.caches, mods), start=1)]
        for got, want, valid in pairs:
            for g, w in zip(got, want):
                worst = max(worst, float(np.abs(np.asarray(g)[b, ..., :valid, :] - np.asarray(w)[0, ..., :valid, :])
                                          .max()))
    return {"max_diff": worst, "accepted": sum(stats["accepted"]), "reached": sum(stats["reached"]),
            "layouts": layouts(st)}


def distribution() -> str:
    """The sampled-distribution check of tests/test_speculative.py on tensor=2: "ok" or its failure."""
    model = build_model(_cfg(vocab_size=6, mtp_depth=2), seed=2)
    _sharpen(model, 5.0)
    try:
        _check_target_distribution(on_mesh(model, mesh_of(dict(tensor=2))), dict(temperature=1.0, top_k=2),
                                   ALL_SCHEMES[:3])
    except AssertionError as e:
        return f"failed: {e}"
    return "ok"


def main_worker() -> dict:
    assert jax.device_count() == 4
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: notes.append(r.getMessage())
    logging.getLogger("mtpjax.decode").addHandler(handler)
    ms = models()
    out = {"cases": {}}
    cases(ms, out)
    out["caches"] = caches_after_rejections(ms["gqa"])
    out["distribution"] = distribution()
    out["notes"] = notes
    return out


if __name__ == "__main__":
    result = main_worker()
    Path(sys.argv[2]).write_text(json.dumps(result))
