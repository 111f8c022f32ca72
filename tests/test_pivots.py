"""Decisions marked by a task, their tokens, and the credit/pivot_* metrics, against values worked out by hand."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from scgrpo.pivots import (BOTH, NONE, RIGHT, WRONG, Decision, DecisionError, auroc, decision_labels, label_turn,
                           model_turns, pivot_metrics, read_decisions, token_offsets)

# a vocabulary of multi-character tokens, and two tokens that each hold one byte of "é" (b"\xc3\xa9")
VOCAB = {0: b"", 1: b"I", 2: b" go", 3: b" le", 4: b"ft", 5: b" then", 6: b" right", 7: b"ab", 8: b"\xc3",
         9: b"\xa9", 10: b" ", 11: b"left"}


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_the_forms_of_a_decision_are_read_alike_and_bad_ones_refused():
    want = Decision(5, 9, False, 2)
    assert read_decisions([(2, (5, 9), False)]) == [want]
    assert read_decisions([{"turn": 2, "span": [5, 9], "correct": False}]) == [want]
    assert read_decisions([{"start": 5, "end": 9, "correct": False}], turn=2) == [want]  # the step's own turn
    assert read_decisions([Decision(5, 9, False)], turn=2) == [want]
    assert read_decisions([want.as_info()]) == [want]
    for bad in ("left", [{"span": [5, 9]}], [{"span": [9, 5], "correct": True}], [{"span": [1, 2], "correct": 1}],
                [(0, (1, 2, 3), True)], [{"span": ["a", 2], "correct": True}], {"span": [1, 2]}):
        with pytest.raises(DecisionError):
            read_decisions(bad)


def test_token_offsets_follow_the_decoded_text_also_where_a_character_splits_over_tokens():
    assert token_offsets(decode, [1, 2, 3, 4], strip=False) == [(0, 1), (1, 4), (4, 7), (7, 9)]
    # "aé": the first byte of é decodes to a replacement character alone, so the prefixes are used: the
    # character belongs to the token that completes it
    assert token_offsets(decode, [7, 8, 9], strip=False) == [(0, 2), (2, 2), (2, 3)]
    # an episode's turn is stripped before the environment reads it: " left" is read as "left"
    assert token_offsets(decode, [10, 11, 0], strip=True) == [(-1, 0), (0, 4), (4, 4)]


def test_tokens_are_labelled_by_the_decisions_they_overlap():
    # "I go left then right": "left" (5..9) wrong covers " le" (4..7) in part and "ft"; "right" (15..20) right
    offsets = token_offsets(decode, [1, 2, 3, 4, 5, 6], strip=False)
    decisions = [Decision(5, 9, False), Decision(15, 20, True)]
    assert label_turn(offsets, decisions) == [NONE, NONE, WRONG, WRONG, NONE, RIGHT]
    # one token "ab" split by two decisions: "a" right, "b" wrong
    assert label_turn([(0, 2)], [Decision(0, 1, True), Decision(1, 2, False)]) == [BOTH]
    # a token that covers no character (a special token) is never a decision token
    assert label_turn([(4, 4)], [Decision(0, 9, True)]) == [NONE]


def test_an_episodes_decisions_land_on_the_tokens_of_their_own_turn():
    # completion: turn 0 = " left" (ids 10 11), an observation (5), turn 1 = "I go" (1 2), then padding
    ids = torch.tensor([[10, 11, 5, 1, 2, 0]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]])
    assert model_turns(mask[0].tolist()) == [(0, 2), (3, 5)]
    infos = [{"env": [{"decisions": [{"span": [0, 4], "correct": True}]},
                      {"decisions": [{"span": [2, 4], "correct": False},
                                     {"turn": 0, "span": [0, 1], "correct": False}]}]}]  # judged later
    labels, malformed = decision_labels(ids, mask, infos, episode=True, decode=decode)
    assert malformed == 0
    # turn 0's "left" is both right (its own step) and wrong (the later judgement of its first letter)
    assert labels.tolist() == [[NONE, BOTH, NONE, NONE, WRONG, NONE]]


def test_a_verifiers_decisions_land_on_the_completions_tokens_and_bad_rows_are_counted():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    infos = [{"decisions": [{"span": [5, 9], "correct": True}]}, {"extracted": None},
             {"decisions": "not a list"}]
    labels, malformed = decision_labels(ids, mask, infos, episode=False, decode=decode)
    assert malformed == 1
    assert labels.tolist() == [[NONE, NONE, RIGHT, RIGHT], [NONE] * 4, [NONE] * 4]
    assert decision_labels(ids, mask, [{}, {}, {}], episode=False, decode=decode)[0] is None  # nothing marked


def brute_auroc(positive, negative):
    """The AUROC from its definition: the share of (positive, negative) pairs ordered right, ties half."""
    pairs = list(itertools.product(positive, negative))
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def test_auroc_matches_its_pairwise_definition():
    assert auroc(torch.tensor([0.8, 0.6, 0.2]), torch.tensor([0.2, 0.7])) == pytest.approx(3.5 / 6)
    assert auroc(torch.tensor([0.3, 0.3]), torch.tensor([0.3])) == 0.5
    assert math.isnan(auroc(torch.tensor([]), torch.tensor([0.1])))
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        pos = torch.randint(0, 5, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator) / 4
        neg = torch.randint(0, 5, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator) / 4
        assert auroc(pos, neg) == pytest.approx(brute_auroc(pos.tolist(), neg.tolist()))


def test_pivot_metrics_by_hand():
    """Rows 0 and 1 count; row 2 is not a failed partial-solve row with a teacher; row 3 marks no decision.

    wrong-decision weights {0.8, 0.6} (row 0) and {0.2} (row 1); right {0.2} (row 0) and {0.7} (row 1); row 0's
    last token lies in a right and a wrong decision (one token split by two): a decision token, in neither class.
    AUROC: 0.8 beats both rights (2), 0.6 beats 0.2 (1), 0.2 ties 0.2 (0.5): 3.5 of 6 pairs.
    Share: f of the 7 model tokens 2.9, of the 6 decision tokens 2.8 (all but row 0's first): (2.8/2.9)/(6/7).
    """
    weights = torch.tensor([[0.1, 0.8, 0.6, 0.2, 0.3],
                            [0.7, 0.2, 0.0, 0.0, 0.0],
                            [0.9, 0.9, 0.0, 0.0, 0.0],
                            [0.5, 0.5, 0.0, 0.0, 0.0]])
    labels = torch.tensor([[NONE, WRONG, WRONG, RIGHT, BOTH],
                           [RIGHT, WRONG, WRONG, NONE, NONE],  # (past the row's end: not a model token)
                           [WRONG, RIGHT, NONE, NONE, NONE],
                           [NONE, NONE, NONE, NONE, NONE]], dtype=torch.int8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]])
    rows = torch.tensor([True, True, False, True])
    metrics = pivot_metrics(weights, labels, mask, rows)
    assert metrics["credit/pivot_auroc"] == pytest.approx(3.5 / 6)
    assert metrics["credit/pivot_share"] == pytest.approx((2.8 / 2.9) / (6 / 7))
    assert metrics["credit/pivot_rows"] == 2
    # one turn a row: within turns it is the pooled AUROC; within rows, row 0 (wrong {0.8, 0.6} against right
    # {0.2}: 2 of 2) and row 1 (wrong {0.2} against right {0.7}: 0 of 1), 2 of 3 pairs
    assert metrics["credit/pivot_auroc_turn"] == pytest.approx(3.5 / 6)
    assert metrics["credit/pivot_auroc_row"] == pytest.approx(2 / 3)
    # uniform weights put no more weight on decisions than on the rest, and tell right from wrong not at all
    uniform = pivot_metrics(torch.where(mask.bool(), 0.4, 0.0), labels, mask, rows)
    assert uniform["credit/pivot_share"] == pytest.approx(1.0) and uniform["credit/pivot_auroc"] == 0.5
    # no row counts: no value
    none = pivot_metrics(weights, labels, mask, torch.zeros(4, dtype=torch.bool))
    assert none["credit/pivot_rows"] == 0 and math.isnan(none["credit/pivot_auroc"])
    assert math.isnan(none["credit/pivot_share"])


def test_the_turn_and_row_aurocs_take_position_and_row_level_out_by_hand():
    """Two-turn episodes (an observation token between the turns, mask 0), where the right move comes first and the
    weights grow with the turn: the pooled AUROC reads the position, the turn-stratified one does not.

    row 0: turn 0 right {0.3}, turn 1 wrong {0.9}; row 1: turn 0 right {0.2}, turn 1 wrong {0.8};
    row 2: turn 0 wrong {0.1}, turn 1 right {0.85}.
    Pooled: wrong {0.9, 0.8, 0.1} against right {0.3, 0.2, 0.85}: 0.9 beats 3, 0.8 beats 2, 0.1 none: 5 of 9.
    Turn 0: wrong {0.1} against right {0.3, 0.2}: 0 of 2; turn 1: wrong {0.9, 0.8} against right {0.85}: 1 of 2;
    pooled within turns 1 of 4. Rows: row 0 1 of 1, row 1 1 of 1, row 2 0 of 1: 2 of 3."""
    weights = torch.tensor([[0.3, 0.0, 0.9], [0.2, 0.0, 0.8], [0.1, 0.0, 0.85]])
    labels = torch.tensor([[RIGHT, NONE, WRONG], [RIGHT, NONE, WRONG], [WRONG, NONE, RIGHT]], dtype=torch.int8)
    mask = torch.tensor([[1, 0, 1]] * 3)
    metrics = pivot_metrics(weights, labels, mask, torch.ones(3, dtype=torch.bool))
    assert metrics["credit/pivot_auroc"] == pytest.approx(5 / 9)
    assert metrics["credit/pivot_auroc_turn"] == pytest.approx(1 / 4)
    assert metrics["credit/pivot_auroc_row"] == pytest.approx(2 / 3)
    # a turn holding one class only has no pairs; none at all: NaN
    one_class = pivot_metrics(weights[:2], labels[:2], mask[:2], torch.ones(2, dtype=torch.bool))
    assert math.isnan(one_class["credit/pivot_auroc_turn"]) and one_class["credit/pivot_auroc"] == 1.0


def test_numpy_integers_and_booleans_are_read_as_plain_ones():
    import numpy as np

    assert read_decisions([{"span": [np.int64(1), np.int32(3)], "correct": np.bool_(True), "turn": np.int64(2)}]) \
        == [Decision(1, 3, True, 2)]
    with pytest.raises(DecisionError):
        read_decisions([{"span": [True, 3], "correct": True}])


def test_a_weighted_verifier_keeps_its_parts_decisions():
    from scgrpo.verifiers import NumericVerifier
    from scgrpo.verifiers.combined import WeightedVerifier

    result = WeightedVerifier([NumericVerifier(), NumericVerifier()], [0.5, 0.5]).verify("so 41", 42)
    assert result.info["decisions"] == [{"span": [3, 5], "correct": False}] * 2
