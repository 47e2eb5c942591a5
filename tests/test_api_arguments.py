"""The Python API called as a notebook user calls it: every documented argument form works, and a bad argument is
one MtpjaxError naming the fix, never a TypeError, IndexError or an error from inside JAX."""

import numpy as np
import pytest

from mtpjax.decode import generate
from mtpjax.nn.model import build_model


@pytest.fixture(scope="module")
def model():
    from mtpjax.config import ModelConfig
    from conftest import SMALL

    return build_model(ModelConfig(**SMALL), seed=0)


def test_a_2d_int_array_of_prompts_generates_as_the_list_does(model):
    """check_token_prompts accepts [batch, length] int arrays (docs/api.md); generate decodes them, not a ValueError
    from asking an array for its truth value."""
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    want = generate(model, ids.tolist(), max_new_tokens=3)
    assert generate(model, ids, max_new_tokens=3).tokens == want.tokens
    assert generate(model, ids[:1], max_new_tokens=3, draft=1).tokens == want.tokens[:1]
