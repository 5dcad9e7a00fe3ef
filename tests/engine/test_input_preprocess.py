"""`process_prompt`: a prompt in, plain int token ids out, or a ValueError naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.engine.input_preprocess import process_prompt

VOCAB = 100


def test_token_ids_of_any_integer_type_come_out_as_plain_ints():
    for ids in ([3, 1, 4], np.array([3, 1, 4]), (np.int32(3), 1, np.int64(4)), range(3, 6)):
        text, token_ids = process_prompt({"prompt_token_ids": ids}, None, VOCAB)
        assert text is None and token_ids == list(map(int, ids))
        assert all(type(t) is int for t in token_ids)


def test_the_callers_list_is_not_the_one_kept():
    ids = [5, 6]
    _, token_ids = process_prompt({"prompt_token_ids": ids}, None, VOCAB)
    ids.append(7)  # the caller reuses its list
    assert token_ids == [5, 6]


@pytest.mark.parametrize("ids", [[1, VOCAB], [-1], [1, True], [1.0], ["3"]])
def test_ids_outside_the_vocabulary_or_not_integers_are_refused(ids):
    with pytest.raises(ValueError, match="prompt must be token ids") as refused:
        process_prompt({"prompt_token_ids": ids}, None, VOCAB)
    assert refused.value.param == "prompt"
