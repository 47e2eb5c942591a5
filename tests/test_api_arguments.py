"""The Python API called as a notebook user calls it: every documented argument form works, and a bad argument is
one MtpjaxError naming the fix, never a TypeError, IndexError or an error from inside JAX."""

import numpy as np
import pytest

from conftest import SMALL

from mtpjax.config import ConfigError, load_config, replace
from mtpjax.decode import DecodeError, generate, make_loop, run, summarize
from mtpjax.drafts import MAX_NODES, DraftError, Tree, chain, parse
from mtpjax.errors import MtpjaxError
from mtpjax.nn.model import build_model
from mtpjax.train.checkpoint import CheckpointError, SavedRun


@pytest.fixture(scope="module")
def model():
    from mtpjax.config import ModelConfig

    return build_model(ModelConfig(**SMALL), seed=0)


def test_a_2d_int_array_of_prompts_generates_as_the_list_does(model):
    """check_token_prompts accepts [batch, length] int arrays (docs/api.md); generate decodes them, not a ValueError
    from asking an array for its truth value."""
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    want = generate(model, ids.tolist(), max_new_tokens=3)
    assert generate(model, ids, max_new_tokens=3).tokens == want.tokens
    assert generate(model, ids[:1], max_new_tokens=3, draft=1).tokens == want.tokens[:1]


@pytest.mark.parametrize("make", [
    lambda: Tree((-1, 2, 0), ("mtp",) * 3),  # a parent after its child
    lambda: Tree((0,), ("mtp",)),  # its own parent
    lambda: Tree((-1, 0), ("mtp",)),  # a node without a source
    lambda: Tree((-1,), ("mpt",)),  # an unknown source
    lambda: Tree((-1, 0.5), ("mtp",) * 2),  # not a node index
    lambda: chain(MAX_NODES + 1),  # past the one limit of any draft
    lambda: chain(-1),  # was the empty tree: plain decoding
])
def test_a_tree_built_in_code_is_checked_when_built(make):
    """Tree(parents, sources) and chain(n) are documented constructors; a malformed one is a DraftError (an
    MtpjaxError) when built, not an IndexError, a broadcasting error from inside the compiled loop, or plain
    decoding."""
    with pytest.raises(DraftError) as e:
        make()
    assert isinstance(e.value, MtpjaxError) and "\n" not in str(e.value)


def test_companion_a_tree_given_as_lists_or_numpy_ints_is_the_tuple_tree(model):
    tree = Tree([-1, -1, np.int64(0)], ["mtp"] * 3)
    assert tree == Tree((-1, -1, 0), ("mtp",) * 3) and hash(tree) == hash(parse("-1,-1,0"))
    assert chain(np.int64(2)) == chain(2) == parse("2")
    assert generate(model, [[1, 2, 3]], max_new_tokens=4, draft=tree).tokens == \
        generate(model, [[1, 2, 3]], max_new_tokens=4).tokens


@pytest.mark.parametrize("kw", [
    dict(max_new_tokens=4.0), dict(max_new_tokens="4"), dict(max_new_tokens=None), dict(max_new_tokens=True),
    dict(temperature="0.7"), dict(temperature=None), dict(top_k=2.5, temperature=1.0), dict(top_p="0.9"),
    dict(seed=None), dict(seed=1.5), dict(eos_id="2"), dict(eos_id=SMALL["vocab_size"]), dict(max_len="64"),
    dict(on_commit=5),
])
def test_a_bad_argument_of_generate_is_one_decode_error(model, kw):
    """Each was a TypeError or ValueError from deep inside (a comparison, jnp.zeros' shape, jax.random.key, a
    callback failing inside the compiled loop), or silently something else: top_k=2.5 ran as 2, an eos_id past the
    vocabulary never stopped a row."""
    with pytest.raises(DecodeError) as e:
        generate(model, [[1, 2, 3]], **{"max_new_tokens": 4, **kw})
    assert "\n" not in str(e.value)


def test_companion_numpy_scalars_are_numbers_as_python_ones_are(model):
    want = generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=1.0, top_k=3, top_p=0.9, seed=7, eos_id=1)
    got = generate(model, [[1, 2, 3]], max_new_tokens=np.int64(4), temperature=np.float32(1.0), top_k=np.int32(3),
                   top_p=0.9, seed=np.int64(7), eos_id=np.int32(1))
    assert got.tokens == want.tokens


@pytest.mark.parametrize("budget", [0, -3, 2.5])
def test_a_budget_under_one_token_or_not_a_count_is_refused(model, budget):
    """run(budget=0) decoded one token and budget=2.5 two: a cap that is not a count of at least one token is a
    DecodeError (the prefill always commits the first token)."""
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=6)
    with pytest.raises(DecodeError, match="budget"):
        run(model, [[1, 2, 3]], loop, budget=budget)
    assert [len(t) for t in summarize(run(model, [[1, 2, 3]], loop, budget=2), loop.tree).tokens] == [2]


def test_a_callback_given_to_a_loop_that_does_not_stream_is_refused(model):
    """run(on_commit=f) with a loop built without stream=True silently never called f."""
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=4, draft=1)
    with pytest.raises(DecodeError, match="stream=True"):
        run(model, [[1, 2, 3]], loop, on_commit=lambda toks, counts: None)
    heard = []
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=4, draft=1, stream=True)
    st = run(model, [[1, 2, 3]], loop, on_commit=lambda toks, counts: heard.extend(toks[0, :counts[0]].tolist()))
    assert heard == summarize(st, loop.tree).tokens[0]


@pytest.mark.parametrize("call", [lambda: load_config(None, "model.d_model=64"),
                                  lambda: replace(load_config(), "model.d_model=64")])
def test_overrides_given_as_one_string_name_the_list(call):
    """load_config(path, "model.d_model=64") iterated the string and refused its first character: "override 'm' is
    not of the form section.key=value"; the message now names the list the call wants."""
    with pytest.raises(ConfigError, match=r"\['model.d_model=64'\]"):
        call()
    assert replace(load_config(), ["model.d_model=64"]).model.d_model == 64


@pytest.mark.parametrize("step", ["4", 4.0])
def test_a_step_that_is_not_an_int_is_named_as_such(tmp_path, step):
    """load_model(run, step="4") said "has no checkpoint at step 4; available: [4]"; now it names the type."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    with SavedRun(tmp_path) as saved:
        with pytest.raises(CheckpointError, match=r"step=.*4.* is not a checkpoint step: give an int"):
            saved.step(step)
        assert saved.step(np.int64(4)) == 4 and saved.step() == 4


@pytest.mark.parametrize("temperature", [1e-30, 1e-45])
@pytest.mark.parametrize("draft", [0, 2])
def test_a_tiny_temperature_samples_the_greedy_tokens(model, temperature, draft):
    """Sampling at temperature -> 0 is greedy decoding (docs/decoding.md); logits / 1e-30 overflowed float32 to inf,
    softmax gave NaN and every draw was token 0."""
    prompts = [[1, 2, 3], [7, 8]]
    want = generate(model, prompts, max_new_tokens=10).tokens
    assert generate(model, prompts, max_new_tokens=10, draft=draft, temperature=temperature).tokens == want


@pytest.mark.parametrize("draft", [-1, np.int64(-2)])
def test_a_negative_count_of_drafts_is_refused(model, draft):
    """draft=-1 was read as the parent-list spelling "-1" and drafted one token each round, silently."""
    with pytest.raises(DecodeError, match="not a count of drafts"):
        generate(model, [[1, 2, 3]], max_new_tokens=4, draft=draft)
    assert generate(model, [[1, 2, 3]], max_new_tokens=4, draft="-1").draft == chain(1)  # the parent list itself


@pytest.mark.parametrize("prompts, error", [
    ([[1] * 17], "longer than this loop takes"),  # was a numpy broadcasting ValueError
    ([[40, 2]], "outside the vocabulary"),  # was decoded from a clamped embedding lookup, silently
    ([[]], "empty prompt"),  # was decoded from position -1, silently
    ("abc", "prompts is text"),
])
def test_run_checks_its_prompts_as_make_loop_does(model, prompts, error):
    """A Loop is compiled once and run on other prompts (docs/api.md); run checked none of them."""
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=6)
    assert loop.prompt_pad == 16
    with pytest.raises(MtpjaxError, match=error):
        run(model, prompts, loop)
    st = run(model, [[1] * 16, [2, 3]], loop)
    assert summarize(st, loop.tree).tokens == generate(model, [[1] * 16, [2, 3]], max_new_tokens=6).tokens


@pytest.mark.parametrize("kw, error", [
    (dict(first_guess=[2.0]), "first_guess"),  # was an estimate of 7 tokens a round, and drafted by it
    (dict(first_guess=[-1.0]), "first_guess"),
    (dict(first_guess="0.6"), "first_guess"),  # was a ValueError from float('.')
    (dict(first_guess=0.6), "first_guess"),  # was a TypeError
    (dict(progress=5), "progress"),  # was a TypeError once measuring began
    (dict(calibrations="cal.json"), "SavedCalibrations"),  # was an AttributeError
])
def test_auto_s_own_arguments_are_checked_before_anything_runs(model_cfg, kw, error):
    fresh = build_model(model_cfg(), seed=0)  # auto remembers its measurement per model: a fresh one measures
    with pytest.raises(DecodeError, match=error):
        generate(fresh, [[1, 2, 3]], max_new_tokens=4, draft="auto", plain_first=True, **kw)


@pytest.mark.parametrize("kw, error", [
    (dict(model=None), "model is a NoneType, not a model"),
    (dict(model="gen"), r"a Generator's model is model.model"),  # mtpjax.load's Generator passed as the model
    (dict(draft=1, proposer="model", draft_model="runs/draft_tiny"), "draft_model is a str, not a model"),
])
def test_something_other_than_a_model_is_named(model, kw, error):
    """Each was an AttributeError ('... has no attribute cfg')."""
    from mtpjax.data import ByteTokenizer
    from mtpjax.decode import Generator

    if kw.get("model") == "gen":
        kw["model"] = Generator(model, ByteTokenizer())
    with pytest.raises(DecodeError, match=error):
        generate(**{"model": model, "prompts": [[1, 2, 3]], "max_new_tokens": 4, **kw})
    with pytest.raises(DecodeError, match=error):
        make_loop(**{"model": model, "prompts": [[1, 2, 3]], "max_new_tokens": 4, **kw})
