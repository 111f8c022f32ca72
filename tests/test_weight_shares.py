"""scripts/weight_shares.py: the decision-token rules and the f shares, by hand."""

import json

import pytest

from tests.helpers import load_script

ws = load_script("weight_shares")


def test_arithmetic_decisions_are_digits_and_operators():
    tokens = ["The", " answer", " is", " 1", "2", ".", " 3", " +", " 4", " =", " 7", "!", " well", "-", "known"]
    assert ws.decision_tokens(tokens, "arith") == [False, False, False, True, True, False, True, True, True, True,
                                                   True, False, False, True, False]


def test_tool_decisions_are_the_calls_and_their_arguments():
    tokens = ["Let", " me", " use", " calc", "(", "3", " *", " (", "4", ")", ")", " then", " answer", " 12"]
    assert ws.decision_tokens(tokens, "tool", ["calc"]) == [False] * 3 + [True] * 8 + [False] * 3
    tagged = ["ok", " <tool_call>", '{"name"', ': "calc"}', "</tool_call>", " done"]
    assert ws.decision_tokens(tagged, "tool") == [False, True, True, True, True, False]
    assert ws.decision_tokens(["a", " calc", "(1"], "tool", ["calc"]) == [False, True, True]  # unclosed: to the end
    with pytest.raises(ValueError, match="unknown task"):
        ws.decision_tokens(["a"], "chess")


def test_word_decisions_are_the_first_move_of_each_model_turn():
    tokens = ["I", " will", " Hit", ".", " Hitting", " is", " bold", ";", " st", "ick", " now", " white"]
    # one turn (no flags): "Hit" in any case is its first move; "Hitting" is not in the list; the later "stick" is
    # not what the environment takes; "white" holds "hit" but not as a word
    assert ws.decision_tokens(tokens, "words", ["hit", "stick"]) == [False, False, True] + [False] * 9
    assert ws.decision_tokens(tokens, "words", []) == [False] * len(tokens)
    # "I hit or stick" in one turn marks "hit" only; the environment's reply is never marked, and a second turn's
    # first move ("stick", split over two tokens) is marked too; "stand" after it in that turn is not
    turns = ["I", " hit", " or", " stick", " You", " drew", " stick", " st", "ick", " then", " stand"]
    model = [1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert ws.decision_tokens(turns, "words", ["hit", "stick", "stand"], model) == [
        False, True, False, False, False, False, False, True, True, False, False]
    # as the environment reads: no word character on either side (an underscore or digit joins), longer words first
    assert ws.decision_tokens(["hit_me", " 2hit", " stands", " hit"], "words", ["hit", "stand", "stands"]) == [
        False, False, True, False]
    assert ws.model_turns([0, 1, 1, 0, 1, 0, 0, 1]) == [(1, 3), (4, 5), (7, 8)]
    with pytest.raises(SystemExit, match="needs --words"):
        ws.main(["somewhere", "--task", "words"])


def test_the_words_rule_picks_what_the_environment_picks():
    pytest.importorskip("gymnasium")
    from scgrpo.data.gym import BlackjackTask

    env = BlackjackTask(num_train=1, num_eval=1, num_ood=1).default_environment()
    words = list(BlackjackTask.ACTIONS)
    for text in ("I will Hit, then stick", "sticking with it; hit later", "STAND.", "stands? hits!", "hitme stay",
                 "no move here"):
        tokens = [text[k:k + 3] for k in range(0, len(text), 3)]  # pieces that cut words
        marked = [k for k, d in enumerate(ws.decision_tokens(tokens, "words", words)) if d]
        read = env._pattern.search(text)  # what choose() reads
        assert marked == ([k for k in range(len(tokens)) if 3 * k < read.end() and read.start() < 3 * k + 3]
                          if read else [])


def _row(step, route, tokens, model, f, has_teacher=True, row=0):
    return {"step": step, "row": row, "route": route, "has_teacher": has_teacher, "tokens": tokens, "model": model,
            "f": f}


ROWS = [
    # decision tokens " 1", "2" (f .8, .6); other "x", "." (f .1, .3): mass share 1.4 / 1.8, token share 2 / 4
    _row(0, "partial", ["x", " 1", "2", "."], [1, 1, 1, 1], [0.1, 0.8, 0.6, 0.3]),
    # an environment token (model 0) never counts, whatever its text
    _row(0, "solve_none", ["a", " 5", "b"], [1, 0, 1], [0.2, 0.9, 0.4], row=1),
    _row(0, "partial", ["9"], [1], [1.0], has_teacher=False, row=2),  # no teacher: f undefined, left out
    _row(5, "partial", [" 3", "y"], [1, 1], [0.5, 0.5]),
]


def test_shares_by_hand():
    result = ws.weight_shares(ROWS, "arith")
    partial0 = result["by_step"]["0"]["partial"]
    assert partial0["tokens"] == 4 and partial0["decision_tokens"] == 2
    assert partial0["decision_f_share"] == pytest.approx(1.4 / 1.8)
    assert partial0["decision_token_share"] == pytest.approx(0.5)
    assert partial0["concentration"] == pytest.approx((1.4 / 1.8) / 0.5)
    assert partial0["mean_f_decision"] == pytest.approx(0.7) and partial0["mean_f_other"] == pytest.approx(0.2)
    none0 = result["by_step"]["0"]["solve_none"]
    assert none0["tokens"] == 2 and none0["decision_tokens"] == 0 and none0["mean_f_decision"] is None
    overall = result["overall"]["partial"]  # steps 0 and 5: decisions .8 .6 .5, others .1 .3 .5
    assert overall["decision_f_share"] == pytest.approx(1.9 / 2.8)
    assert result["overall"]["pooled"]["tokens"] == 8
    assert result["rule_version"] == ws.RULE_VERSION["arith"] and ws.weight_shares([], "words")["rule_version"] == 2


def test_a_step_logged_again_keeps_its_last_block_only():
    first = [_row(0, "partial", ["1"], [1], [1.0], row=k) for k in range(3)]
    later = [_row(10, "partial", ["1"], [1], [1.0], row=k) for k in range(3)]
    again = [_row(0, "solve_none", ["2"], [1], [0.5], row=k) for k in range(2)]  # fewer rows than the first block
    kept = ws.last_blocks(first + later + again)
    assert [(r["step"], r["row"], r["route"]) for r in kept] == [(0, 0, "solve_none"), (0, 1, "solve_none"),
                                                                 (10, 0, "partial"), (10, 1, "partial"),
                                                                 (10, 2, "partial")]
    # two batches logged at one step (rows counted from 0 in each): the second is kept, not merged with the first
    second = [_row(10, "single", ["3"], [1], [0.2], row=k) for k in range(2)]
    assert [(r["step"], r["route"]) for r in ws.last_blocks(later + second)] == [(10, "single")] * 2
    # a block logged in pieces, rows in any order, is one block
    assert len(ws.last_blocks([first[2], first[0], first[1]])) == 3


def test_the_command_writes_json_and_markdown_and_says_what_is_missing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "credit_tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ws.main([str(run), "--task", "arith", "--out", str(tmp_path / "w")])
    saved = json.loads((tmp_path / "w.json").read_text())
    assert saved["overall"]["partial"]["decision_f_share"] == pytest.approx(1.9 / 2.8)
    assert "| all steps | partial | 6 |" in (tmp_path / "w.md").read_text()
    assert "wrote" in capsys.readouterr().out
    # a resumed run that logged step 0 again, with fewer rows: step 0's new block replaces its old one whole (row 1,
    # the solve-none row, is not kept from the old block); step 5 stays
    again = _row(0, "partial", ["x", " 1", "2", "."], [1, 1, 1, 1], [0.1, 0.2, 0.2, 0.3])
    with open(run / "credit_tokens.jsonl", "a") as f:
        f.write(json.dumps(again) + "\n")
    ws.main([str(run), "--task", "arith", "--out", str(tmp_path / "r")])
    resumed = json.loads((tmp_path / "r.json").read_text())["by_step"]
    assert set(resumed["0"]) == {"partial", "pooled"} and resumed["0"]["pooled"]["tokens"] == 4
    assert resumed["0"]["partial"]["decision_f_share"] == pytest.approx(0.4 / 0.8)
    assert resumed["5"]["partial"]["tokens"] == 2
    with pytest.raises(SystemExit, match="not found"):
        ws.main([str(tmp_path / "nowhere"), "--task", "arith"])
    (run / "credit_tokens.jsonl").write_text(json.dumps(_row(0, "partial", ["1"], [1], [1.0], False)) + "\n")
    with pytest.raises(SystemExit, match="no row with a teacher"):
        ws.main([str(run), "--task", "arith", "--out", str(tmp_path / "v")])
