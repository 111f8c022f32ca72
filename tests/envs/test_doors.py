"""The doors task: rooms drawn from the seed, the first door name as the move, reward only for every move right,
each move marked as its turn's decision, and policies that do not read the room at chance."""

from __future__ import annotations

import random

import pytest

from scgrpo.data import TASKS, DoorsTask
from scgrpo.envs import Action, DoorsEnv
from scgrpo.envs.doors import OOD_NAMES, first_name


def play(env: DoorsEnv, row: dict, replies, seed: int = 0):
    episode = env.spawn()
    first = episode.reset(row, seed)
    results = [episode.step(Action(reply(episode, k) if callable(reply) else reply)) for k, reply in
               zip(range(len(episode.layout)), replies if not callable(replies) else [replies] * len(episode.layout))]
    return first, results, episode


def right_reply(episode, k):
    a, b, key = episode.layout[k]
    return f"I open the {(a, b)[key].upper()} door, not the {(a, b)[1 - key]} one."


def test_every_right_move_scores_1_and_each_move_is_its_turns_decision():
    task = DoorsTask(rooms=4)
    row = task.rows("id")[0]
    first, results, episode = play(task.default_environment(), row, right_reply)
    a, b = episode.doors
    # two worked rooms as chat turns, then the first room
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant", "user"]
    assert first[0]["content"].startswith(f"Every room has a {a} door and a {b} door.")
    assert first[1]["content"] in (a, b) and first[-1]["content"] == episode._room_text(0)
    assert [r.done for r in results] == [False, False, False, True] and results[-1].reward == 1.0
    assert all(r.reward == 0.0 for r in results[:-1])  # no feedback until the end
    assert [r.observation for r in results[:3]] == [episode._room_text(k) for k in (1, 2, 3)]
    for k, result in enumerate(results):
        a, b, key = episode.layout[k]
        reply = right_reply(episode, k)
        (decision,) = result.info["decisions"]
        assert decision["correct"] is True and reply[slice(*decision["span"])].lower() == (a, b)[key]
    assert results[-1].info["right_moves"] == 4


def test_one_wrong_move_scores_0_and_is_marked_wrong():
    env = DoorsEnv(rooms=3, shots=0)
    row = {"id": "r", "question": "doors", "answer": {"seed": 5}}
    assert isinstance(play(env, row, [])[0], str)  # without worked rooms the first message is text

    def one_wrong(episode, k):
        a, b, key = episode.layout[k]
        return (a, b)[1 - key] if k == 1 else (a, b)[key]

    _, results, _ = play(env, row, one_wrong)
    assert results[-1].reward == 0.0 and results[-1].info["right_moves"] == 2
    assert [r.info["decisions"][0]["correct"] for r in results] == [True, False, True]
    _, silent, _ = play(env, row, ["no idea", "none", "?"])
    assert all("decisions" not in r.info for r in silent) and silent[-1].reward == 0.0  # no door named: no decision


def test_the_seed_fixes_the_rooms_and_a_group_shares_it():
    env = DoorsEnv(rooms=5)
    row = {"id": "r", "question": "doors", "answer": {}}
    layouts = [play(env, row, ["x"] * 5, seed=s)[2].layout for s in (7, 7, 8)]
    assert layouts[0] == layouts[1] != layouts[2]  # the runner's seed, shared by a group's episodes
    fixed = {"id": "r", "question": "doors", "answer": {"seed": 3}}
    assert play(env, fixed, ["x"] * 5, seed=1)[2].layout == play(env, fixed, ["x"] * 5, seed=2)[2].layout


@pytest.mark.parametrize("rule", ["named", "larger", "mixed"])
@pytest.mark.parametrize("policy", ["first", "second", "left-word", "alternate", "red"])
def test_policies_that_do_not_read_the_room_succeed_at_chance(policy, rule):
    """Over 4,000 episodes of 3 rooms: 1/8 each, within 4 standard errors (0.021)."""
    env = DoorsEnv(rooms=3, rule=rule, digits=1)
    wins = 0
    for n in range(4000):
        episode = env.spawn()
        episode.reset({"id": str(n), "answer": {}}, n)
        reward = 0.0
        for k, (a, b, _) in enumerate(episode.layout):
            reply = {"first": a, "second": b, "left-word": "left", "alternate": (a, b)[k % 2],
                     "red": "red"}[policy]
            reward = episode.step(Action(reply)).reward
        wins += reward
    # "left" names no door; "red" is one of the episode's doors a third of the time (2 of 6 names drawn), then
    # right with probability 1/8 over 3 rooms: 1/24
    expected = {"left-word": 0.0, "red": 1 / 24}.get(policy, 1 / 8)
    assert abs(wins / 4000 - expected) < 0.021


@pytest.mark.parametrize("rule,expected", [("named", 1.0), ("larger", 1 / 8), ("mixed", 1 / 2)])
def test_echoing_the_room_text_solves_what_can_be_copied_and_no_more(rule, expected):
    """A policy that replies with the room's own text (its first door name is the move): a named room names the
    key's door, so it is always right there; a numbered room names the first door first, right half the time.
    Over 3 rooms: named 1, larger 1/8, mixed (named, numbered, named) 1/2: the mixed task's only decision that
    cannot be copied is its numbered room. Within 4 standard errors of 4,000 episodes (at most 0.032)."""
    env = DoorsEnv(rooms=3, rule=rule, digits=1)
    wins = 0
    for n in range(4000):
        episode = env.spawn()
        text = episode.reset({"id": str(n), "answer": {}}, n)
        reward = 0.0
        for k in range(3):
            room = text[-1]["content"] if isinstance(text, list) else text.split("\n\n")[-1]
            result = episode.step(Action(room))
            reward, text = result.reward, result.observation
        wins += reward
    assert abs(wins / 4000 - expected) < 0.032


def test_first_name_is_the_earliest_whole_word_in_any_case():
    assert first_name("Blue, then red", ("red", "blue")) == (1, (0, 4))
    assert first_name("reddish bluebird", ("red", "blue")) == (None, None)
    assert first_name("the RED one", ("red", "blue")) == (0, (4, 7))


def test_the_task_splits_and_the_ood_rooms_and_names():
    task = TASKS["doors"](rooms=3, ood_rooms=5, num_eval=8, num_ood=8)
    ids = {r["answer"]["seed"] for r in task.rows("id")}
    assert len(task.rows("id")) == 8 and not ids & {r["answer"]["seed"] for r in task.rows("train")[:2000]}
    ood = task.rows("ood")[0]
    first, results, episode = play(task.default_environment(), ood, right_reply)
    assert len(results) == 5 and results[-1].reward == 1.0
    assert {n for a, b, _ in episode.layout for n in (a, b)} <= set(OOD_NAMES)
    with pytest.raises(ValueError, match="rooms"):
        DoorsTask(rooms=0)
    with pytest.raises(ValueError, match="names"):
        DoorsEnv(names=["red"])
    with pytest.raises(ValueError, match="of the rule 'named' needs {key}"):
        DoorsEnv(room="Room {room}: {a} or {b}?")
    with pytest.raises(ValueError, match="of the rule 'larger' needs {x} and {y}"):
        DoorsEnv(rule="larger", room="The key is behind the {key} door.")
    with pytest.raises(ValueError, match="rule must be one of"):
        DoorsEnv(rule="smaller")
    with pytest.raises(ValueError, match="digits"):
        DoorsTask(rule="larger", digits=0)
    with pytest.raises(ValueError, match="shots"):
        DoorsEnv(shots=-1)


def test_the_rule_larger_puts_the_key_behind_the_larger_number_of_the_room_and_of_each_worked_room():
    task = DoorsTask(rule="larger", rooms=3, digits=1, shots=2, num_eval=64, num_ood=8)
    env = task.default_environment()
    for row in task.rows("id")[:64]:
        first, results, episode = play(env, row, right_reply)
        assert results[-1].reward == 1.0 and len(episode.numbers) == 5  # 2 worked rooms, then 3 rooms
        assert all(1 <= n <= 9 for pair in episode.numbers for n in pair)
        for (x, y), (a, b, key) in zip(episode.numbers[2:], episode.layout):
            assert x != y and key == int(y > x)
        a, b = episode.doors
        for k, turn in enumerate(first[0:4:2]):  # the worked rooms: the larger number's door is the reply
            x, y = episode.numbers[k]
            assert f"The {a} door shows {x} and the {b} door shows {y}." in turn["content"]
            assert first[2 * k + 1]["content"] == (a, b)[int(y > x)]
        x, y = episode.numbers[2]
        assert first[-1]["content"].startswith(f"The {a} door shows {x} and the {b} door shows {y}.")
        assert "{" not in first[-1]["content"] and results[0].info["numbers"] == [x, y]
    # the key's side is drawn per room, not fixed by the rule
    keys = [key for row in task.rows("id")[:64] for _, _, key in play(env, row, right_reply)[2].layout]
    assert 0.35 < sum(keys) / len(keys) < 0.65
    ood = task.rows("ood")[0]
    assert ood["answer"]["digits"] == 2 and ood["answer"]["rooms"] == 6
    _, results, episode = play(env, ood, right_reply)
    assert len(results) == 6 and results[-1].reward == 1.0
    assert all(10 <= n <= 99 for pair in episode.numbers for n in pair)  # a digit more


def test_the_rule_named_draws_the_rooms_it_drew_before_the_rule_larger_existed():
    """The committed runs' episodes (benchmarks/results/credit/runs) stay what they were: the worked rooms' keys
    first, then the rooms', one draw each."""
    row = {"id": "r", "question": "doors", "answer": {"seed": 11, "rooms": 4}}
    episode = play(DoorsEnv(shots=2), row, [])[2]
    rng = random.Random(11)
    a, b = rng.sample(list(dict.fromkeys(DoorsEnv().names)), 2)
    keys = [rng.randrange(2) for _ in range(6)]
    assert episode.layout == [(a, b, key) for key in keys[2:]] and episode.numbers == []


def test_the_rule_mixed_alternates_named_and_numbered_rooms_worked_rooms_first():
    task = DoorsTask(rule="mixed", rooms=3, digits=1, shots=4, num_eval=16, num_ood=4)
    env = task.default_environment()
    for row in task.rows("id"):
        first, results, episode = play(env, row, right_reply)
        assert results[-1].reward == 1.0
        kinds = ["larger" if n else "named" for n in episode.numbers]
        assert kinds == ["named", "larger"] * 3 + ["named"]  # 4 worked rooms, then 3 rooms
        a, b = episode.doors
        for k, ((x_y), (_, _, key)) in enumerate(zip(episode.numbers[4:], episode.layout)):
            text = results[k - 1].observation if k else first[-1]["content"]
            if x_y is None:
                assert text == f"The key is behind the {(a, b)[key]} door. Which door do you open?"
                assert "numbers" not in results[k].info
            else:
                assert text.startswith(f"The {a} door shows {x_y[0]} and the {b} door shows {x_y[1]}.")
                assert key == int(x_y[1] > x_y[0]) and results[k].info["numbers"] == list(x_y)
    with pytest.raises(ValueError, match="takes no room text"):
        DoorsEnv(rule="mixed", room="The key is behind the {key} door.")
