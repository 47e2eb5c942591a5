"""Array names keep their promise at run time: every suffixed name in a function of the package holds a value of
as many axes as its suffix has letters (`x_BTD`: rank 3), checked where both are visible.

A tracer watches the functions of `mtpjax/` while a tiny model's loss and gradients are traced (dense attention,
MLA with a mixture of experts, micro-batches) and a few tokens are decoded speculatively: when a function returns,
each of its local names with a shape suffix (its arguments among them), and each suffixed field of a dataclass it
holds (DecodeState.cache_..., a Request's arrays), is held against the value's `.shape`. jax traces with abstract
values, so every shape is known without running the model; tests/test_shapes.py checks the letters themselves.
"""

import dataclasses
import functools
import re
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mtpjax.config import LossConfig, ModelConfig
from mtpjax.nn.model import build_model
from mtpjax.train.step import loss_and_grads, split_trainable

PACKAGE = str(Path(__file__).resolve().parent.parent / "mtpjax") + "/"
SUFFIXED = re.compile(r"^_*[a-z][a-z0-9]*(?:_[a-z0-9]+)*_([A-Z][A-Z0-9]*)$")  # as tests/test_shapes.py reads them
# Sizes no other test uses, so nothing here is served from a jit cache without being traced again.
BASE = dict(vocab_size=40, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40, mtp_depth=2, dtype="float32",
            param_dtype="float32")
MLA_MOE = dict(BASE, attention_kind="mla", kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4,
               v_head_dim=6, mlp_kind="moe", n_routed_experts=4, num_experts_per_tok=2, moe_d_ff=12, n_group=2,
               topk_group=1)


# Names still lying, awaiting a rename: (file, function, reason). Each must still be caught
# (test_pending_names_still_lie), so none outlives its fix.
PENDING = {
    ("mtpjax/nn/layers.py", "_attend_parts", "R·T query rows merged into one axis: the alphabet has no letter for it"),
    ("mtpjax/nn/layers.py", "_attend_hm_fwd", "the same merged R·T axis"),
    ("mtpjax/nn/layers.py", "_attend_hm_bwd", "the same merged R·T axis"),
    ("mtpjax/nn/layers.py", "attend", "the same merged R·T axis"),
    ("mtpjax/nn/layers.py", "attend_cached", "the same merged R·T axis"),
    ("mtpjax/decode/cache.py", "write_rows", "[B,S] or [B,S,D] buffers under one name (decode/ is being renamed)"),
    ("mtpjax/decode/cache.py", "read_rows", "the same"),
    ("mtpjax/decode/cache.py", "take_rows", "x[b, idx[b]] of arrays with trailing axes"),
}


class RankWatch:
    """A sys.settrace tracer: at each return from a function of the package, its suffixed names against their ranks."""

    def __init__(self):
        self.checked: Counter = Counter()  # package-relative file -> names checked there
        self.wrong: set = set()  # (file, function, name, shape)

    def __enter__(self):
        self.old = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.old)

    def _call(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # no events from this frame
        frame.f_trace_lines = False  # only its return
        return self._return

    def _return(self, frame, event, arg):
        if event == "return":
            where = frame.f_code.co_filename[len(PACKAGE) - len("mtpjax/"):], frame.f_code.co_qualname
            for name, value in frame.f_locals.items():
                self.check(where, name, value)
        return self._return

    def check(self, where: tuple, name: str, value) -> None:
        """One name against its value; a dataclass of the package's has its fields checked as `Type.field`."""
        m = SUFFIXED.match(name.rpartition(".")[2])
        shape = getattr(value, "shape", None)
        if m and isinstance(shape, tuple):
            self.checked[where[0]] += 1
            if len(shape) != len(m.group(1)):
                self.wrong.add((*where, name, shape))
        elif dataclasses.is_dataclass(value) and type(value).__module__.startswith("mtpjax."):
            for f in dataclasses.fields(value):
                if SUFFIXED.match(f.name):
                    self.check(where, f"{type(value).__name__}.{f.name}", getattr(value, f.name, None))


def exercise(cfg: ModelConfig, micro_batches: int = 1) -> None:
    """Trace a batch's loss and gradients (jax.eval_shape: nothing compiled) and decode speculatively."""
    from mtpjax.decode import generate

    model = build_model(cfg)
    from flax import nnx

    graphdef, params = nnx.split(model)
    tok = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    f = functools.partial(loss_and_grads, graphdef=graphdef, loss_cfg=LossConfig(), micro_batches=micro_batches)
    jax.eval_shape(f, *split_trainable(params), tok, tok, jnp.int32(0))
    generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, draft=2)


@pytest.fixture(scope="module")
def watched() -> RankWatch:
    with RankWatch() as watch:
        exercise(ModelConfig(**BASE), micro_batches=2)
        exercise(ModelConfig(**MLA_MOE))
    return watch


def test_every_array_name_has_its_values_rank(watched):
    pending = {(f, fn) for f, fn, _ in PENDING}
    wrong = sorted(w for w in watched.wrong if w[:2] not in pending)
    assert not wrong, "\n".join(f"{f}:{fn}: {n} holds shape {s}" for f, fn, n, s in wrong)


def test_pending_names_still_lie(watched):
    fixed = {(f, fn) for f, fn, _ in PENDING} - {w[:2] for w in watched.wrong}
    assert not fixed, f"fixed now, drop from PENDING: {sorted(fixed)}"


def test_the_watch_saw_the_model_the_loss_and_the_decoder(watched):
    files = set(watched.checked)
    assert {"mtpjax/nn/layers.py", "mtpjax/nn/mla.py", "mtpjax/nn/moe.py", "mtpjax/nn/model.py",
            "mtpjax/nn/loss.py", "mtpjax/decode/loop.py"} <= files, sorted(files)
    assert sum(watched.checked.values()) > 1000


def test_companion_a_name_that_lies_about_its_rank_is_caught(monkeypatch):
    """moe.grouped_swiglu's rows `x_ID` renamed `x_BID` (one axis too many) in a copy of the function."""
    import inspect

    from mtpjax.nn import moe

    lied = inspect.getsource(moe.grouped_swiglu).replace("x_ID", "x_BID")
    namespace = dict(vars(moe))  # the function's globals; its code keeps the package's file name
    exec(compile(lied, moe.__file__, "exec"), namespace)
    x_ID, e_I = jnp.ones((6, 4)), jnp.array([0, 0, 1, 1, 1, 2])
    w = jnp.ones((3, 4, 5)), jnp.ones((3, 4, 5)), jnp.ones((3, 5, 4))
    with RankWatch() as watch:
        jax.eval_shape(lambda x, e: namespace["grouped_swiglu"](x, e, jnp.bincount(e, length=3), *w, "blocks"),
                       x_ID, e_I)
    assert {(fn, n) for _, fn, n, _ in watch.wrong} == {("grouped_swiglu", "x_BID")}
    with RankWatch() as watch:  # and the function as it is passes
        jax.eval_shape(lambda x, e: moe.grouped_swiglu(x, e, jnp.bincount(e, length=3), *w, "blocks"), x_ID, e_I)
    assert not watch.wrong and watch.checked["mtpjax/nn/moe.py"] >= 4
