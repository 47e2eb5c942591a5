"""The private APIs mtpjax calls (jax._src's plugin registration, lm-eval's HarnessCLI parsers) are where it calls
them: each lives in one module (mtpjax.parallel.jax_private, mtpjax.cli.lm_eval_private) whose `moved()` names the
upgrade that moved one; companions: a moved internal is reported, naming the installed and the written-against
versions."""

import importlib.util

import pytest

from mtpjax.parallel import jax_private


def test_jax_s_internals_are_where_mtpjax_calls_them():
    assert jax_private.moved() == [], "\n".join(jax_private.moved())


def test_companion_a_moved_jax_internal_names_the_upgrade(monkeypatch):
    import jax

    monkeypatch.setitem(jax_private.USED, "register_pjrt_plugins", ("jax._src.xla_bridge", "_gone"))
    (line,) = jax_private.moved()
    assert line.startswith(f"jax {jax.__version__} (mtpjax was written against {jax_private.WRITTEN_AGAINST}) has "
                           "no jax._src.xla_bridge._gone, which mtpjax.parallel.jax_private.register_pjrt_plugins")


needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="the eval extra")


@needs_lm_eval
def test_lm_eval_s_parsers_are_where_mtpjax_reads_them():
    from mtpjax.cli import lm_eval_private

    assert lm_eval_private.moved() == [], "\n".join(lm_eval_private.moved())
    assert "run" in lm_eval_private.harness_parsers().commands


@needs_lm_eval
def test_companion_moved_lm_eval_parsers_name_the_upgrade(monkeypatch):
    import lm_eval._cli

    from mtpjax.cli import lm_eval_private

    class Renamed:  # a release that renamed the parsers
        def __init__(self):
            self.parser = None

    monkeypatch.setattr(lm_eval._cli, "HarnessCLI", Renamed)
    (line,) = lm_eval_private.moved()
    assert f"(mtpjax was written against {lm_eval_private.WRITTEN_AGAINST}) has no lm_eval._cli.HarnessCLI" in line
    assert line.startswith("lm-eval 0.") and "AttributeError" in line
