"""n-gram prompt lookup: what it proposes, checked against its definition."""

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.spec_decode.ngram_worker import ngram_lookup


def test_the_latest_occurrence_of_the_longest_suffix_wins():
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 7, 1, 2]
    assert ngram_lookup(tokens, k=2, n_min=1, n_max=2) == [4, 7]  # "1 2" last seen before "4 7"
    assert ngram_lookup([5, 6, 7, 8, 5, 6], k=5, n_min=1, n_max=3) == [7, 8, 5, 6]  # fewer than k left
    assert ngram_lookup([1, 2, 3], k=2, n_min=1, n_max=3) == []  # nothing repeats
    assert ngram_lookup([4], k=2, n_min=1, n_max=3) == []
    assert ngram_lookup([3, 3], k=2, n_min=1, n_max=3) == [3]
    assert ngram_lookup([1, 2, 8, 2], k=1, n_min=2, n_max=3) == []  # only a 1-gram matches


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_a_proposal_continues_an_earlier_occurrence_of_the_longest_matching_suffix(tokens, k, n_min, extra):
    n_max = n_min + extra
    proposal = ngram_lookup(tokens, k, n_min, n_max)
    length = len(tokens)

    def starts(n):  # earlier windows equal to the last n tokens, followed by at least one token
        return [i for i in range(length - n) if n < length and tokens[i:i + n] == tokens[length - n:]]

    matching = [n for n in range(n_min, n_max + 1) if starts(n)]
    if not matching:
        assert proposal == []
        return
    n = max(matching)
    i = max(starts(n))
    assert proposal == tokens[i + n: i + n + k]
    assert 1 <= len(proposal) <= k
