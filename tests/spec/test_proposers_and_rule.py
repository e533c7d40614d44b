"""The n-gram lookup, the draft-spec syntax and the adaptive rule, without a model."""
import numpy as np
import pytest

from tokenmill.config import EngineArgs
from tokenmill.spec.adaptive import Acceptance, StepCost, best_k, expected_tokens
from tokenmill.spec.draft import parse_draft
from tokenmill.spec.ngram import ngram_lookup


def lookup(tokens, k=3, n_max=3, n_min=1):
    return ngram_lookup(np.asarray(tokens), k, n_max, n_min)


def test_ngram_takes_the_longest_then_most_recent_match():
    #             a  b  c  X  Y  b  c  Z  W  a  b  c
    assert lookup([1, 2, 3, 7, 8, 2, 3, 5, 6, 1, 2, 3]) == [7, 8, 2]          # "a b c" matched at the start
    assert lookup([2, 3, 7, 8, 2, 3, 5, 6, 9, 2, 3]) == [5, 6, 9]             # "b c" twice: the most recent
    assert lookup([1, 2, 3, 7, 8, 2, 3, 5, 6, 1, 2, 3], n_min=4, n_max=4) == []
    assert lookup([4, 5, 4], k=5) == [5, 4]                                   # the continuation may be short
    assert lookup([1, 2, 3, 4]) == [] and lookup([5], n_min=1) == []


def test_ngram_respects_minimum_length():
    assert lookup([1, 9, 8, 2, 3, 1], n_min=1) == [9, 8, 2]
    assert lookup([1, 9, 8, 2, 3, 1], n_min=2) == []


def test_speculative_options_are_validated():
    assert parse_draft("draft:self@int4") == ("self", "int4")
    assert parse_draft("draft:/m/small") == ("/m/small", None)
    with pytest.raises(ValueError, match="draft:<model>"):
        parse_draft("draft:")
    for bad in (dict(speculative="medusa"), dict(speculative="ngram", num_speculative_tokens=0),
                dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2)):
        with pytest.raises(ValueError):
            EngineArgs(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(speculative=4), r"speculative must be a string or null, got 4 \(int\)"),
    (dict(speculative="medusa"), r"speculative must be 'ngram' or 'draft:<model>\[@<quantization>\]', got 'medusa'"),
    (dict(speculative="draft:"), r"speculative='draft:': expected 'draft:<model>'"),
    (dict(speculative="draft:self@"), r"speculative='draft:self@': expected 'draft:<model>'"),
    (dict(speculative="draft:self@int3"), r"speculative='draft:self@int3': the draft's quantization method 'int3'"),
    (dict(speculative="ngram", num_speculative_tokens=2.5), "num_speculative_tokens must be an integer, got 2.5"),
    (dict(speculative="ngram", num_speculative_tokens=True), "num_speculative_tokens must be an integer, got True"),
    (dict(speculative="ngram", prompt_lookup_min=1.5), "prompt_lookup_min must be an integer, got 1.5"),
    (dict(speculative="ngram", num_speculative_tokens=64, max_num_batched_tokens=64),
     r"num_speculative_tokens must be in \[1, max_num_batched_tokens - 1 = 63\].*got 64"),
])
def test_bad_speculative_options_name_the_option(bad, match):
    """Refused when the arguments are built, before any model loads: a bad draft spec used to surface only after
    the target was loaded, a float count as a TypeError deep in the adaptive rule."""
    with pytest.raises(ValueError, match=match):
        EngineArgs(**bad)


def test_speculative_counts_are_not_checked_without_speculation():
    assert EngineArgs(max_num_batched_tokens=4).num_speculative_tokens == 4


def test_rule_speculates_only_when_it_gains():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert best_k(0.9, 0.05, 8) >= 6           # cheap verification, high acceptance: long drafts
    assert best_k(0.3, 0.05, 8) in (1, 2, 3)   # low acceptance: short drafts
    assert best_k(0.04, 0.05, 8) == 0          # gain below cost: off
    assert best_k(0.95, 1.0, 8) == 0           # a large batch (verification as dear as decoding): off


def test_acceptance_tracks_and_recovers():
    acc = Acceptance()
    for _ in range(20):
        acc.update(4, 0)
    assert acc.alpha < 0.05
    for _ in range(100):
        acc.recover()
    assert acc.alpha > 0.5                     # an off request is probed again later
    for _ in range(20):
        acc.update(4, 4)
    assert acc.alpha > 0.95


def test_step_cost_fit():
    cost = StepCost()
    assert cost.fit() is None
    for n, verified in [(1, 0), (5, 1), (1, 0), (3, 1), (2, 1), (1, 0), (4, 1)] * 3:
        cost.observe(n, 0.1 + 0.01 * n + 0.03 * verified, bool(verified))
    a, b, o = cost.fit()
    assert a == pytest.approx(0.1, rel=0.05) and b == pytest.approx(0.01, rel=0.1) and o == pytest.approx(0.03, rel=0.1)
    c, overhead = cost.costs(1, 0.0)
    assert c == pytest.approx(0.01 / 0.11, rel=0.1) and overhead == pytest.approx(0.03 / 0.11, rel=0.1)
    c, overhead = cost.costs(64, 0.0)
    assert c > 0.8                             # a large batch: verification costs nearly a token each


def test_step_cost_without_spread_leans_on_the_prior():
    cost = StepCost()
    for _ in range(10):
        cost.observe(5, 0.2, True)             # always the same n, always verifying
    a, b, o = cost.fit()
    assert a + 5 * b + o == pytest.approx(0.2, rel=0.05) and b > 0
