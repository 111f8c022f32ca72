"""The gymnasium adapter: actions parsed from text, invalid replies, rewards, done flags and seeds on
gymnasium's Blackjack and FrozenLake; the rows of GymTask and the packaged blackjack task; and README's
corridor (a user's own environment) through the same adapter, by entry point, by registered id and from a file (its
training run, ``scgrpo fit --config corridor.yaml`` as README writes it: tests/test_readme_sections.py)."""

from __future__ import annotations

import os
import re
import sys

import gymnasium
import pytest

from scgrpo.data import TASKS, BlackjackTask, GymTask, resolve_source
from scgrpo.envs import Action, GymnasiumEnv
from scgrpo.verifiers import VerifierSetupError
from tests.helpers import code_blocks, readme_section

LAKE = ["SFF", "FHF", "FFG"]  # right, right, down, down reaches G; down, right falls into H
MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}


def lake_text(obs, info, env) -> str:
    """FrozenLake's map with the player's cell marked P, and where the player is."""
    desc = env.unwrapped.desc
    row, col = divmod(int(obs), desc.shape[1])
    lines = [[c.decode() for c in line] for line in desc]
    lines[row][col] = "P"
    return "\n".join(" ".join(line) for line in lines) + f"\nYou are at row {row + 1}, column {col + 1}."


def lake(**kwargs) -> GymnasiumEnv:
    settings = dict(make_kwargs={"is_slippery": False, "desc": LAKE}, actions=MOVES,
                    render="tests.envs.test_gym:lake_text", instructions="Reach G.")
    settings.update(kwargs)
    return GymnasiumEnv("FrozenLake-v1", **settings)


def play(env: GymnasiumEnv, replies: list[str], row=None, seed: int = 0):
    """Plays ``replies`` in a fresh copy of ``env`` until the episode ends: its first observation and steps"""
    episode = env.spawn()
    first = episode.reset(row if row is not None else {"id": "r", "question": "", "answer": 7}, seed)
    steps = []
    for reply in replies:
        steps.append(episode.step(Action(reply)))
        if steps[-1].done:
            break
    return first, steps


@pytest.fixture(scope="session")
def corridor_package(tmp_path_factory) -> str:
    """README's ``my_pkg/corridor.py``, importable."""
    root = tmp_path_factory.mktemp("user")
    os.makedirs(root / "my_pkg")
    (root / "my_pkg" / "__init__.py").write_text("")
    (code,) = [b.body for b in code_blocks(readme_section("### Your own gymnasium environment"))
               if b.file == "my_pkg/corridor.py"]
    (root / "my_pkg" / "corridor.py").write_text(code)
    sys.path.insert(0, str(root))
    return str(root)


# ---------------------------------------------------------------- actions from text
@pytest.mark.parametrize("reply, action", [
    ("right", 2), ("RIGHT!", 2), ("I go down, not up", 1), ("Up.", 3), ("left\n", 0),
    ("upright? no: left", 0),  # whole words only
])
def test_the_first_action_word_in_the_reply_is_the_action(reply, action):
    env = lake().spawn()
    env.reset({"answer": 0}, 0)
    assert env.choose(reply) == action


def test_synonyms_map_to_one_action_and_a_longer_word_wins_where_two_start():
    env = GymnasiumEnv("Blackjack-v1", actions={"hit": 1, "hitting": 1, "stick": 0, "stick with it": 0})
    assert env.choose("Hitting.") == 1
    assert env.choose("I'd stick with it, then hit") == 0
    assert env.choose("hitter") is None


def test_without_actions_a_discrete_space_takes_its_action_numbers():
    env = GymnasiumEnv("FrozenLake-v1", make_kwargs={"is_slippery": False})
    assert env.actions == {"0": 0, "1": 1, "2": 2, "3": 3}
    _, steps = play(env, ["2"])
    assert steps[0].info["action"] == 2


def test_by_default_the_observation_is_the_ansi_rendering_without_colours_else_str_of_it():
    first, steps = play(GymnasiumEnv("FrozenLake-v1", make_kwargs={"is_slippery": False, "desc": LAKE},
                                     instructions="Go."), ["2"])
    assert first == "Go.\n\nSFF\nFHF\nFFG"  # the ansi rendering marks the player by a colour, dropped here
    assert steps[0].observation == "  (Right)\nSFF\nFHF\nFFG"
    first, _ = play(GymnasiumEnv("Blackjack-v1"), [], row={"answer": 3})  # no ansi rendering: str(obs)
    assert re.fullmatch(r"\(\d+, \d+, [01]\)", first)


# ---------------------------------------------------------------- invalid replies
def test_a_reply_without_an_action_is_answered_with_the_valid_words_and_counted():
    _, steps = play(lake(max_invalid=3), ["hello", "right", "what?", "right"])
    assert [s.done for s in steps] == [False] * 4
    assert steps[0].observation == "That is not a valid move. Reply with one of: left, down, right, up."
    assert steps[0].info == {"invalid": True, "invalid_turns": 1}
    assert steps[1].info["action"] == 2 and "row 1, column 2" in steps[1].observation
    assert steps[2].info["invalid_turns"] == 2 and steps[3].info["invalid_turns"] == 2
    assert all(s.reward == 0 for s in steps)


def test_the_valid_words_listed_are_the_first_of_each_action():
    env = GymnasiumEnv("Blackjack-v1", actions={"hit": 1, "hitting": 1, "stick": 0, "stand": 0})
    _, steps = play(env, ["?"])
    assert steps[0].observation.endswith("Reply with one of: hit, stick.")


def test_max_invalid_replies_end_the_episode_with_reward_0():
    _, steps = play(lake(max_invalid=2), ["right", "nope", "right", "nope", "down"])
    assert len(steps) == 4 and steps[-1].done and steps[-1].info["invalid_turns"] == 2
    assert sum(s.reward for s in steps) == 0 and steps[-1].info["success"] is False


# ---------------------------------------------------------------- rewards and done
def test_reaching_the_goal_scores_1_at_the_last_step_only():
    first, steps = play(lake(), ["right", "right", "down", "down"])
    assert first.startswith("Reach G.\n\nP F F\nF H F\nF F G\nYou are at row 1, column 1")
    assert [s.done for s in steps] == [False, False, False, True]
    assert [s.reward for s in steps] == [0, 0, 0, 1.0]
    assert steps[-1].info == {"action": 1, "gym_reward": 1.0, "invalid_turns": 0, "terminated": True,
                              "truncated": False, "success": True}


def test_falling_into_a_hole_ends_the_episode_with_reward_0():
    _, steps = play(lake(), ["down", "right"])
    assert [s.done for s in steps] == [False, True] and steps[-1].reward == 0.0
    assert steps[-1].info["terminated"] and not steps[-1].info["success"]


def test_a_truncated_episode_ends_and_scores_0():
    _, steps = play(lake(make_kwargs={"is_slippery": False, "desc": LAKE, "max_episode_steps": 2}),
                    ["right", "right", "down"])
    assert len(steps) == 2 and steps[-1].done
    assert steps[-1].info["truncated"] and not steps[-1].info["terminated"] and steps[-1].reward == 0


def blackjack_outcome(seed: int, replies: list[str], **kwargs):
    env = GymnasiumEnv("Blackjack-v1", actions={"hit": 1, "stick": 0}, **kwargs)
    _, steps = play(env, replies, row={"answer": seed})
    return steps


def test_success_reward_maps_blackjack_wins_to_1_and_losses_and_draws_to_0_raw_keeps_its_reward():
    outcomes = {}
    for seed in range(60):
        success, raw = blackjack_outcome(seed, ["stick"]), blackjack_outcome(seed, ["stick"], reward="raw")
        assert success[-1].done and raw[-1].done
        outcomes[raw[-1].reward] = success[-1].reward
        assert success[-1].info["gym_reward"] == raw[-1].reward
    assert outcomes == {1.0: 1.0, 0.0: 0.0, -1.0: 0.0}


def test_the_success_threshold_is_on_the_sum_of_gymnasium_rewards():
    # the lake's goal gives 1: a threshold of 1 asks for more than that
    _, steps = play(lake(success_threshold=1.0), ["right", "right", "down", "down"])
    assert steps[-1].done and steps[-1].reward == 0 and not steps[-1].info["success"]


def test_no_step_after_the_episode_ended():
    env = lake().spawn()
    env.reset({"answer": 0}, 0)
    for reply in ["down", "right"]:
        env.step(Action(reply))
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(Action("up"))


# ---------------------------------------------------------------- seeds and rows
def test_a_row_seed_replays_the_same_episode_and_other_seeds_differ():
    def transcript(seed):
        first, steps = play(GymnasiumEnv("Blackjack-v1", actions={"hit": 1, "stick": 0},
                                         render="scgrpo.envs.gym:blackjack_text"),
                            ["hit", "hit", "hit", "stick"], row={"answer": {"seed": seed}}, seed=99)
        return [first] + [(s.observation, s.reward) for s in steps]

    assert transcript(3) == transcript(3)
    assert len({str(transcript(s)) for s in range(8)}) > 4


def test_the_row_seed_wins_over_the_runners_and_without_one_the_runners_is_used():
    env = GymnasiumEnv("Blackjack-v1", actions={"hit": 1, "stick": 0},
                       render="scgrpo.envs.gym:blackjack_text")
    starts = {s: env.spawn().reset({"answer": None}, s) for s in range(8)}
    assert env.spawn().reset({"answer": {"seed": 5}}, 1) == starts[5]
    assert env.spawn().reset({"answer": 5}, 2) == starts[5]
    assert env.spawn().reset({}, 6) == starts[6]


def test_row_make_kwargs_go_over_the_environments_own():
    env = lake()
    first = env.spawn().reset({"answer": {"seed": 0, "make_kwargs": {"desc": ["SF", "FG"]}}}, 0)
    assert "P F\nF G\n" in first


@pytest.mark.parametrize("answer, message", [
    ("seven", "must be a seed, a dict or null"),
    ({"seed": 1, "level": 2}, "has keys ['level']"),
    ({"seed": "1"}, "seed must be an int"),
    ({"make_kwargs": [1]}, "make_kwargs must be a dict"),
])
def test_a_malformed_row_answer_is_named(answer, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        lake().spawn().reset({"answer": answer}, 0)


def test_the_instructions_default_to_the_rows_question():
    first, _ = play(lake(instructions=None), [], row={"question": "Find the goal.", "answer": 0})
    assert first.startswith("Find the goal.\n\nP F F")


def test_a_spawned_copy_plays_its_own_environment():
    template = lake()
    a, b = template.spawn(), template.spawn()
    a.reset({"answer": 0}, 0)
    b.reset({"answer": 0}, 0)
    a.step(Action("right"))
    assert "row 1, column 1" in b.step(Action("up")).observation  # b did not move with a
    assert template._env is None


# ---------------------------------------------------------------- settings that cannot work
@pytest.mark.parametrize("kwargs, message", [
    (dict(env_id="NoSuchEnv-v0"), "env_id 'NoSuchEnv-v0'"),
    (dict(), "give one of env_id and entry_point"),
    (dict(env_id="Blackjack-v1", entry_point="a.b:C"), "give one of env_id and entry_point"),
    (dict(entry_point="no_such_module:Env"), "cannot import 'no_such_module'"),
    (dict(entry_point="scgrpo.envs.gym"), "expected an import path"),
    (dict(env_id="Blackjack-v1", actions={"hit": 5}), "not actions of its action space"),
    (dict(env_id="Blackjack-v1", actions={"hit": True}), "not actions of its action space"),
    (dict(env_id="Blackjack-v1", reward="score"), "reward must be one of"),
    (dict(env_id="Blackjack-v1", max_invalid=0), "max_invalid must be >= 1"),
    (dict(env_id="Blackjack-v1", render="scgrpo.envs.gym:no_such_renderer"), "has no 'no_such_renderer'"),
    (dict(env_id="FrozenLake-v1", make_kwargs={"slippery": False}), "gymnasium.make"),
])
def test_settings_that_cannot_work_fail_when_the_environment_is_configured(kwargs, message):
    with pytest.raises(Exception, match=re.escape(message)):
        GymnasiumEnv(**kwargs)


def test_a_space_that_is_not_discrete_needs_a_parse_function():
    with pytest.raises(ValueError, match="is not Discrete; give parse"):
        GymnasiumEnv("MountainCarContinuous-v0")
    env = GymnasiumEnv("MountainCarContinuous-v0", parse="tests.envs.test_gym:parse_push")
    env = env.spawn()
    env.reset({"answer": 0}, 0)
    assert env.step(Action("push 0.5")).info["action"] == "[0.5]"
    assert env.step(Action("wait")).info == {"invalid": True, "invalid_turns": 1}


def parse_push(text, env):
    import numpy as np

    match = re.search(r"push (-?[0-9.]+)", text)
    return np.array([float(match.group(1))], dtype=np.float32) if match else None


def test_without_gymnasium_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'scgrpo[gym]'")):
        GymnasiumEnv("Blackjack-v1")


# ---------------------------------------------------------------- GymTask and the packaged tasks
def test_gym_task_rows_carry_disjoint_seeds_and_the_ood_settings():
    task = GymTask("Blackjack-v1", instructions="Play.", ood_make_kwargs={"sab": True}, num_train=50,
                   num_eval=10, num_ood=10, seed=3)
    assert task.splits() == ["train", "id", "ood"] and task.eval_splits() == ["id", "ood"]
    rows = {s: task.rows(s) for s in task.splits()}
    assert [len(rows[s]) for s in task.splits()] == [50, 10, 10]
    seeds = [r["answer"]["seed"] for s in task.splits() for r in rows[s]]
    assert len(set(seeds)) == 70
    assert all(r["answer"]["make_kwargs"] == {"sab": True} for r in rows["ood"])
    assert all(r["answer"]["make_kwargs"] == {} and r["question"] == "Play." for r in rows["id"])
    assert GymTask("Blackjack-v1", ood_make_kwargs={"sab": True}, num_train=50, num_eval=10, num_ood=10,
                   seed=3).rows("ood")[0]["answer"] == rows["ood"][0]["answer"]
    assert GymTask("Blackjack-v1", num_train=5).splits() == ["train", "id"]


def test_gym_task_scores_through_its_environment_not_a_verifier():
    task = GymTask("Blackjack-v1", actions={"hit": 1, "stick": 0}, num_train=5)
    env = task.default_environment()
    assert isinstance(env, GymnasiumEnv) and env.actions == {"hit": 1, "stick": 0}
    with pytest.raises(VerifierSetupError, match="scored by their environment"):
        task.default_verifier().verify("hit", {"seed": 1})


def test_the_blackjack_task_is_registered_and_plays_its_rows():
    assert TASKS["blackjack"] is BlackjackTask
    blackjack = resolve_source("blackjack")
    row = blackjack.rows("ood")[0]
    assert row["answer"]["make_kwargs"] == {"sab": True}
    first, steps = play(blackjack.default_environment(), ["I will stick."], row=row)
    assert first.startswith(BlackjackTask.INSTRUCTIONS + "\n\nYour cards: ")
    assert first.endswith("The dealer shows: " + first.split("The dealer shows: ")[1].split(".")[0]
                          + ".\nDo you hit (take a card) or stick (stop)? Reply hit or stick.")
    assert steps[0].done and steps[0].info["action"] == 0


# ---------------------------------------------------------------- README's corridor: a user's own environment
def test_readme_corridor_plays_by_entry_point(corridor_package):
    env = GymnasiumEnv(entry_point="my_pkg.corridor:Corridor", make_kwargs={"length": 3}, instructions="Go.",
                       actions={"east": 1, "west": 0})
    first, steps = play(env, ["East", "east", "east", "east"], row={"answer": {"seed": 1}})
    start = int(re.search(r"cell (\d)", first).group(1))
    assert first.startswith("Go.\n\nYou are in cell ")  # str(obs): the observation is text
    assert len(steps) == 3 - start and steps[-1].done and steps[-1].reward == 1.0
    _, fell = play(env, ["west"] * 4, row={"answer": {"seed": 1}})
    assert fell[-1].done and fell[-1].reward == 0 and len(fell) == start + 1


def test_readme_corridor_plays_by_a_registered_id(corridor_package):
    gymnasium.register(id="Corridor-v0", entry_point="my_pkg.corridor:Corridor", max_episode_steps=4)
    try:
        env = GymnasiumEnv("Corridor-v0", actions={"east": 1, "west": 0})
        first, _ = play(env, [], row={"answer": {"seed": 1, "make_kwargs": {"length": 6}}})
        assert "the exit is east of cell 5" in first
        _, steps = play(env, ["east", "west"] * 3, row={"answer": {"seed": 1, "make_kwargs": {"length": 6}}})
        assert len(steps) == 4 and steps[-1].info["truncated"]  # max_episode_steps from the registration
    finally:
        gymnasium.registry.pop("Corridor-v0")


def test_readme_corridor_rows_from_a_file(corridor_package, tmp_path):
    import json

    from scgrpo.data import FileSource

    path = tmp_path / "corridors.jsonl"
    answers = [{"seed": 1, "make_kwargs": {"length": 4}}, {"seed": 2},
               {"seed": None, "make_kwargs": {"length": 9}}]
    path.write_text("".join(json.dumps({"question": "Walk east.", "answer": a}) + "\n" for a in answers))
    rows = FileSource(str(path)).rows("train")
    env = GymnasiumEnv(entry_point="my_pkg.corridor:Corridor", actions={"east": 1, "west": 0})
    firsts = [env.spawn().reset(row, 5) for row in rows]
    assert firsts[0] == env.spawn().reset({"question": "Walk east.", "answer": answers[0]}, 0)
    exits = [f.rsplit("the exit is ", 1)[1] for f in firsts]
    assert exits == ["east of cell 3.", "east of cell 2.", "east of cell 8."]
    # a null seed (filled in by the reader) is the runner's
    unseeded = {"question": "Walk east.", "answer": {"make_kwargs": {"length": 9}}}
    assert firsts[2] == env.spawn().reset(unseeded, 5)


@pytest.mark.parametrize("total, dealer, ace, stick", [
    (20, 10, 0, True), (17, 1, 0, True), (16, 6, 0, True), (16, 7, 0, False), (13, 2, 0, True),
    (12, 3, 0, False), (12, 4, 0, True), (12, 7, 0, False), (11, 6, 0, False), (5, 5, 0, False),
    (19, 10, 1, True), (18, 8, 1, True), (18, 9, 1, False), (18, 1, 1, False), (17, 6, 1, False),
])
def test_blackjack_basic_strategy_by_hand(total, dealer, ace, stick):
    """Hit/stick basic strategy, dealer standing on 17: stick on hard 17+, 13-16 against 2-6, 12 against 4-6; soft
    19+, soft 18 against 2-8 (a dealer's ace is 1 in the observation)."""
    from scgrpo.envs.gym import blackjack_basic_strategy

    assert blackjack_basic_strategy((total, dealer, ace), 0) is stick
    assert blackjack_basic_strategy((total, dealer, ace), 1) is (not stick)


def test_blackjacks_moves_are_marked_with_the_basic_strategy_verdict_on_the_state_the_model_read():
    from scgrpo.envs.gym import blackjack_basic_strategy

    env = BlackjackTask().default_environment()
    for seed in range(40):
        episode = env.spawn()
        episode.reset({"answer": seed}, seed)
        state = episode._env.unwrapped._get_obs()
        reply = "I will Hit now" if state[0] < 15 else "stick."
        result = episode.step(Action(reply))
        word = (7, 10) if state[0] < 15 else (0, 5)
        right = blackjack_basic_strategy(state, 1 if state[0] < 15 else 0)
        assert result.info["decisions"] == [{"span": list(word), "correct": right}]
        episode.close()
    nothing = env.spawn()
    nothing.reset({"answer": 0}, 0)
    assert "decisions" not in nothing.step(Action("no move here")).info  # no move, no decision
