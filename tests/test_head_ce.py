"""The head fused with its cross-entropy (nn/head_ce.py, issue 46) against XLA's head and cross_entropy, in Pallas
interpret mode: the cross-entropy, the first argmax and both gradients, in both weight layouts, rows and vocabulary
off the tiles; the loss through it on a mesh (rows over fsdp, the vocabulary over tensor) equals one device's through
XLA's head. Companions: a kernel that skips the last vocabulary tile, and one that merges the shards' exp-sums without
rescaling them, do not match. Also: where it runs (loss.head_kernel), and what the compile report counts for it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlo_helpers import one_call
from mtpjax.config import load_config
from mtpjax.nn import head_ce
from mtpjax.nn import loss as L
from mtpjax.nn.model import build_model, head_product, placed

ROOT = Path(__file__).resolve().parents[1]
# 150 rows (tile 64: the last tile part padding), vocabularies of 300 and 200 (tile 128: the last tile part padding)
CASES = [(True, 300), (False, 200)]
ROWS, D = 150, 24


def operands(vocab_first: bool, V: int, tie: bool = False):
    rng = np.random.default_rng(V)
    h = jnp.asarray(rng.normal(size=(ROWS, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, D) if vocab_first else (D, V)) * 0.3, jnp.float32)
    if tie:  # two equal maxima in different vocabulary tiles: the first must win, as jnp.argmax's
        w = w.at[V - 1].set(w[0]) if vocab_first else w.at[:, V - 1].set(w[:, 0])
    tgt = jnp.asarray(rng.integers(0, V, ROWS), jnp.int32)
    probe = jnp.asarray(rng.normal(size=ROWS), jnp.float32)  # a cotangent that differs row by row
    return h, w, tgt, probe


def reference(h, w, tgt, vocab_first):
    logits = head_product(h, w, vocab_first)
    return L.cross_entropy(logits, tgt), jnp.argmax(logits, -1).astype(jnp.int32)


def compare(fn, vocab_first, V):
    """(max relative error of ce, argmax equal, max relative errors of the two gradients) of fn against reference."""
    h, w, tgt, probe = operands(vocab_first, V, tie=True)
    rel = lambda a, b: float(jnp.abs(a - b).max() / jnp.abs(b).max())
    loss = lambda f: lambda h, w: (f(h, w, tgt, vocab_first)[0] * probe).sum()
    (ce, am), (ce0, am0) = fn(h, w, tgt, vocab_first), reference(h, w, tgt, vocab_first)
    g, g0 = jax.grad(loss(fn), (0, 1))(h, w), jax.grad(loss(reference), (0, 1))(h, w)
    return rel(ce, ce0), bool((am == am0).all()), rel(g[0], g0[0]), rel(g[1], g0[1])


def fused(h, w, tgt, vocab_first):
    return head_ce.head_cross_entropy(h, w, tgt, head_ce.Plan(vocab_first, interpret=True, rows=64, vocab=128))


@pytest.mark.parametrize("vocab_first,V", CASES)
def test_the_fused_head_equals_xla_s_head_and_cross_entropy(vocab_first, V):
    err_ce, same_argmax, err_dh, err_dw = compare(fused, vocab_first, V)
    assert err_ce < 1e-6 and same_argmax and err_dh < 2e-6 and err_dw < 2e-6


def test_companion_a_kernel_skipping_the_last_vocabulary_tile_does_not_match(monkeypatch):
    real = head_ce.pl.pallas_call

    def short(kernel, *, grid, **kw):
        return real(kernel, grid=(grid[0], grid[1] - 1), **kw)
    monkeypatch.setattr(head_ce.pl, "pallas_call", short)
    err_ce, same_argmax, err_dh, err_dw = compare(fused, True, 300)
    assert err_ce > 1e-3 and not same_argmax and err_dh > 1e-3


def test_the_fused_head_runs_on_a_tpu_or_interpreted_when_asked(monkeypatch):
    """loss.head_kernel=auto: the kernel on a TPU placement, XLA's head on a CPU unless HEAD_INTERPRET_ENV asks for
    the kernel in interpret mode (tests); loss.head_kernel=xla: XLA's head everywhere."""
    import dataclasses

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["model.n_layers=1"])
    model = build_model(cfg.model, seed=0)
    xla = cfg.loss.model_copy(update={"head_kernel": "xla"})
    assert L.head_plan(model, cfg.loss, 2) is None
    on_tpu = placed(model, dataclasses.replace(model.placement, platform="tpu"))
    assert L.head_plan(on_tpu, cfg.loss, 2) == head_ce.Plan(True) and L.head_plan(on_tpu, xla, 2) is None
    monkeypatch.setenv(L.HEAD_INTERPRET_ENV, "1")
    assert L.head_plan(model, cfg.loss, 2) == head_ce.Plan(True, interpret=True) and L.head_plan(model, xla, 2) is None


@pytest.mark.slow
@pytest.mark.parametrize("patch", ["none", "unscaled_merge"])
def test_on_a_mesh_the_fused_head_equals_one_device(patch, tmp_path):
    """tests/head_ce_worker.py, 4 simulated devices, fsdp 2 x tensor 2: the loss's metrics and gradients with the
    fused head split over rows and vocabulary against one device's XLA head; companion: the shards' exp-sums added
    without rescaling to the common maximum."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "head_ce_worker.py"), patch, str(out)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fused_ran"] and r["sharded"] == [["fsdp"], "tensor"]
    if patch == "none":
        assert r["metric_err"] < 2e-6 and r["grad_err"] < 2e-6
    else:
        assert r["metric_err"] > 1e-3


def _head_call(kind: str, tile: int) -> str:
    """A module whose one instruction is the fused head's custom call: 2048 rows of width 64, a [1024, 64] weight."""
    params = {"h": "bf16[2048,64]{1,0}", "w": "bf16[1024,64]{1,0}", "t": "s32[2048,128]{1,0}"}
    name = f"jit(f)/head/shard_map/mtpjax_head_ce_{kind}_tile{tile}/pallas_call"
    return one_call(params, "f32[2048,128]{1,0}", "tpu_custom_call", f'metadata={{op_name="{name}"}}')


@pytest.mark.parametrize("kind, passes", [("fwd", 1), ("bwd", 2)])
def test_the_counter_reads_the_fused_head_from_its_shapes(kind, passes):
    """2·rows·D·V per pass over the logits (the backward: recomputed, then multiplied into the rows' gradient), and
    the weight read once per tile of rows; companion: the same call under another name is another kernel (its
    weight read once, its FLOPs not the head's)."""
    from mtpjax.parallel import hlo, hlo_calls

    stats = hlo.Program(_head_call(kind, 512)).stats()
    assert stats.calls[hlo_calls.HEAD_CALL] == 1 and stats.attention_flops == 0
    assert stats.flops == passes * 2 * 2048 * 64 * 1024
    rows_bytes, w_bytes, out_bytes = 2048 * 64 * 2 + 2048 * 128 * 4, 1024 * 64 * 2, 2048 * 128 * 4
    assert stats.hbm_bytes == rows_bytes + 4 * w_bytes + out_bytes  # 2048 / 512 tiles of rows
    other = hlo.Program(_head_call(kind, 512).replace("mtpjax_head_ce", "mha")).stats()
    assert hlo_calls.HEAD_CALL not in other.calls and other.flops == 0
    assert other.hbm_bytes == rows_bytes + w_bytes + out_bytes


@pytest.mark.parametrize("D", [768, 7168])
def test_the_tiles_shrink_with_the_width_to_fit_the_kernels_memory(D):
    """small's width keeps 1024 rows a tile; DeepSeek-V3's (7168) halves the tiles until their blocks fit on chip;
    companion: the plan's own tiles at that width would not."""
    plan = head_ce.Plan(True)
    tr, tv = head_ce.tiles(32768, 16384, D, 2, plan)
    assert head_ce._vmem(tr, tv, D, 2) <= head_ce.VMEM_LIMIT * 3 // 4 and tv % 128 == 0 and tr % 8 == 0
    assert (tr == plan.rows) == (D == 768)
    assert (head_ce._vmem(plan.rows, plan.vocab, D, 2) > head_ce.VMEM_LIMIT) == (D == 7168)
