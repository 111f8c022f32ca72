"""Episodes end to end on the tiny model: the runner's tokens and masks, environment tokens kept out of the loss,
the entropy and the divergence, the verified episode in the teacher's prompt, faults, and a short training run."""

from __future__ import annotations

import csv
import glob
import os
import re

import pytest
import torch

from scgrpo.envs import EpisodeSettings
from scgrpo.envs.runner import CallPool, ChatTurns, EpisodeRunner
from scgrpo.objectives import GRPO, SCGRPO
from scgrpo.rollout.types import PromptBatch, RolloutBatch
from scgrpo.selfteacher import SelfTeacher
from scgrpo.update import PolicyUpdate
from tests.envs.scripted import FastClock, Scripted
from tests.helpers import tiny_data, tiny_module, tiny_trainer

ROWS = [{"id": "r1", "question": "one", "answer": 1}, {"id": "r2", "question": "two", "answer": 2}]


@pytest.fixture
def module(tiny_model_dir):
    torch.manual_seed(0)
    m = tiny_module(tiny_model_dir)
    m.configure_model()
    return m


def play(module, env, settings=EpisodeSettings(max_turns=3, max_episode_tokens=64), rows=ROWS, k=2, clock=None,
         **kwargs):
    torch.manual_seed(1)
    runner = EpisodeRunner(env, settings, CallPool(clock, clock.rate) if clock is not None else None)
    return runner, runner.run(module.actor, rows, k, **kwargs)


def rollouts_of(episodes, k=2, rows=ROWS) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=episodes.prompt_ids, prompt_mask=episodes.prompt_mask, completion_ids=episodes.completion_ids,
        completion_mask=episodes.completion_mask, env_mask=episodes.env_mask, truncated=episodes.truncated,
        group_size=k, sample_ids=[r["id"] for r in rows for _ in range(k)], questions=episodes.questions,
        answers=[r["answer"] for r in rows for _ in range(k)], completions=episodes.completions,
        rewards=episodes.rewards, entropy_sum=episodes.entropy_sum, sampler_logprobs=episodes.sampler_logprobs)


def test_an_episode_is_the_model_turns_and_the_rendered_observations_in_order(module):
    tok = module.tokenizer
    _, ep = play(module, Scripted(turns=2))
    chat = ChatTurns(tok)
    for i in range(4):
        ids = ep.completion_ids[i].tolist()
        model, env = ep.completion_mask[i].bool().tolist(), ep.env_mask[i].bool().tolist()
        assert not any(m and e for m, e in zip(model, env))
        # the environment's tokens are one block between the two model turns: obs1 as the template renders it
        env_ids = [t for t, e in zip(ids, env) if e]
        first_turn = [t for t, m in zip(ids[: model.index(False)], model) if m]
        ended = tok.decode([first_turn[-1]]) if first_turn[-1] == tok.eos_token_id else None
        assert env_ids == chat.ids("obs1", ended)
        assert "<|im_start|>user\nobs1<|im_end|>\n<|im_start|>assistant\n" in tok.decode(env_ids)
        assert model.index(False) > 0 and any(model[model.index(False) + len(env_ids):])  # a second model turn
    assert ep.stats["episode/turns_mean"] == 2.0
    assert ep.stats["episode/env_tokens_mean"] == float(ep.env_mask.sum(1).mean())
    assert ep.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # rows with an odd answer
    assert ep.questions == ["Task one", "Task one", "Task two", "Task two"]  # the first observation


def test_sampler_and_trainer_agree_on_every_model_token_of_an_episode(module):
    """The history is never re-tokenized: the trainer's log-prob of each model token equals the sampler's."""
    _, ep = play(module, Scripted(turns=3), EpisodeSettings(max_turns=3, max_episode_tokens=80))
    rollouts = rollouts_of(ep)
    c = rollouts.completion_ids.shape[1]
    module.policy.eval()
    with torch.no_grad():
        trainer = module.actor.token_logprobs(rollouts.input_ids, rollouts.attention_mask, c, entropy=False)[0]
    mask = rollouts.completion_mask.bool()
    assert mask.sum() > 20 and rollouts.env_mask.sum() > 20
    assert (trainer - rollouts.sampler_logprobs)[mask].abs().max() < 1e-4


def test_the_turn_limit_and_the_token_budget_truncate(module):
    _, ep = play(module, Scripted(turns=5), EpisodeSettings(max_turns=2, max_episode_tokens=200))
    assert ep.truncated.all() and ep.stats["episode/truncated"] == 1.0 and ep.stats["episode/turns_mean"] == 2.0
    assert ep.rewards.tolist() == [0.0] * 4
    _, ep = play(module, Scripted(turns=5), EpisodeSettings(max_turns=5, max_episode_tokens=12))
    assert ep.truncated.all() and ep.completion_ids.shape[1] <= 12
    assert ((ep.completion_mask + ep.env_mask).sum(1) <= 12).all()


def test_environment_tokens_carry_no_loss_no_entropy_and_no_divergence(module):
    _, ep = play(module, Scripted(turns=3), EpisodeSettings(max_turns=3, max_episode_tokens=80))
    rollouts = rollouts_of(ep)
    rollouts.rewards = torch.zeros(4)  # solve-none groups: every row but each group's reference has a teacher
    env = rollouts.env_mask.bool()
    # divergence: the teacher's signal is zero at environment tokens, and the solve-none diversity tokens are the
    # first L_i model tokens
    signal = SelfTeacher(SCGRPO().teacher)(module.actor, rollouts, 1.0)
    assert signal.divergence[env].abs().max() == 0 and signal.divergence[rollouts.completion_mask.bool()].abs().max() > 0
    model = rollouts.completion_mask
    for i in torch.nonzero(signal.has_teacher).squeeze(1).tolist():
        length = int(signal.diversity_mask[i].sum())
        assert length == min(int(model[i].sum()), int(model[i ^ 1].sum()))
        assert signal.diversity_mask[i][env[i]].sum() == 0  # counted over model tokens, environment tokens skipped
    rollouts.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # loss: the gradient reaches the log-probs of model tokens only; entropy: the mean over model tokens only
    update = PolicyUpdate(module.actor, GRPO(), lambda loss: loss.backward())
    plan = update.plan(rollouts, None)
    captured = {}
    head = module.actor.head_logprobs

    rows = plan.rows

    def capture(hidden, ids, entropy=True, mask=None):
        logprobs, ent = head(hidden, ids, entropy, mask)
        logprobs.retain_grad()
        ent = ent + 1000.0 * rollouts.env_mask[rows]  # an environment token counted would show
        captured["logprobs"], captured["entropy"] = logprobs, ent
        return logprobs, ent

    module.actor.head_logprobs = capture
    out, entropy = update.micro_batch_loss(rollouts, rows, plan)
    out.loss.backward()
    grad = captured["logprobs"].grad
    assert grad[env[rows]].abs().max() == 0
    assert grad[rollouts.completion_mask[rows].bool()].abs().min() > 0
    mask = rollouts.completion_mask[rows]
    token_entropy = captured["entropy"].detach()
    expected = float(((token_entropy * mask).sum(1) / mask.sum(1)).mean())
    assert float(entropy) == pytest.approx(expected, rel=1e-5) and expected < 100


def test_a_verified_episode_reaches_the_teachers_system_prompt(module):
    _, ep = play(module, Scripted(turns=2), k=3, rows=ROWS[:1])
    rollouts = rollouts_of(ep, k=3, rows=ROWS[:1])
    rollouts.rewards = torch.tensor([1.0, 1.0, 0.0])
    teacher = SelfTeacher(SCGRPO().teacher)
    seen = []
    prompts = teacher.teacher_prompts

    def spy(policy, questions, references):
        out = prompts(policy, questions, references)
        seen.extend(out)
        return out

    teacher.teacher_prompts = spy
    signal = teacher(module.actor, rollouts, 1.0)
    assert signal.references[2] in (ep.completions[0], ep.completions[1])
    assert "[user] obs1" in signal.references[2]  # the transcript holds the observation between the turns
    prompt = next(p for p in seen if signal.references[2] in p.split("<|im_start|>user")[0])  # row 2's teacher prompt
    assert "Verified solution" in prompt.split("<|im_start|>user")[0]
    assert "Task one" in prompt.split("<|im_start|>user")[1]  # the student's own first observation


@pytest.mark.parametrize("fault,counter", [("raise", "episode/env_errors"), ("junk", "episode/env_errors"),
                                           ("nan", "episode/env_errors"), ("info", "episode/env_errors"),
                                           ("reset", "episode/env_errors"),
                                           ("hang", "episode/env_timeouts")])
def test_a_faulty_environment_ends_its_episode_with_reward_0_and_is_counted(module, fault, counter):
    rows = [{"id": "a", "question": "a", "answer": 1}, {"id": "b", "question": "b", "answer": 3}]
    env = Scripted(turns=2, fault=fault, fault_row=3, hang_s=1.0)
    env.timeout_s = 2.0  # (the pool's clock runs 50 times as fast: 40 ms; the hung call is left behind)
    runner, ep = play(module, env, rows=rows, clock=FastClock(50.0))
    assert ep.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert ep.stats[counter] == 2.0
    other = "episode/env_timeouts" if counter == "episode/env_errors" else "episode/env_errors"
    assert ep.stats[other] == 0.0
    assert all(info.get("fault") for info in ep.infos[2:]) and not any(info.get("fault") for info in ep.infos[:2])
    assert (ep.completion_mask[2:].sum(1) > 0).all()  # the faulty episodes still hold their first model turn


def test_each_episode_reads_its_own_first_observation_and_its_own_answers(module):
    import itertools

    counter = itertools.count()

    class Distinct(Scripted):  # every episode its own first observation and answers
        def reset(self, row, seed):
            super().reset(row, seed)
            self.n = next(counter)
            return f"Task {self.n}"

        def step(self, action):
            result = super().step(action)
            if not result.done:
                result.observation = f"obs{self.t} of {self.n}"
            return result

    tok = module.tokenizer
    _, ep = play(module, Distinct(turns=2))
    assert sorted(ep.questions) == [f"Task {n}" for n in range(4)]
    for i, question in enumerate(ep.questions):
        n = question.split()[1]
        prompt = tok.decode(ep.prompt_ids[i][ep.prompt_mask[i].bool()])
        assert prompt.endswith(f"user\nTask {n}<|im_end|>\n<|im_start|>assistant\n")
        env = tok.decode(ep.completion_ids[i][ep.env_mask[i].bool()])
        assert f"obs1 of {n}<|im_end|>" in env and f"[user] obs1 of {n}" in ep.completions[i]


def test_evaluation_plays_episodes_with_seeds_fixed_by_the_row(module):
    seeds = []

    class Seeded(Scripted):
        def reset(self, row, seed):
            seeds.append((row["id"], seed))
            return super().reset(row, seed)

    runner = EpisodeRunner(Seeded(), EpisodeSettings(max_turns=2, max_episode_tokens=64))
    module.episode_runner = runner
    runner.run(module.actor, ROWS, 2, seed=0)
    first = list(seeds)
    seeds.clear()
    module.evaluation.greedy, module.evaluation.k = False, 2  # (k episodes of each row, as above, and no greedy one)
    module.evaluation.start()
    module.validation_step(PromptBatch(ids=[r["id"] for r in ROWS], questions=[r["question"] for r in ROWS],
                                       answers=[r["answer"] for r in ROWS], split="id"), 0)
    assert sorted(seeds) == sorted(first)  # (the resets run in parallel threads: in any order)
    per_row = {row: {seed for r, seed in seeds if r == row} for row, _ in seeds}
    assert all(len(s) == 1 for s in per_row.values()) and per_row["r1"] != per_row["r2"]


def test_training_on_episodes_logs_every_episode_key(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, environment=Scripted(turns=2), objective=SCGRPO(),
                         episodes=EpisodeSettings(max_turns=3, max_episode_tokens=48), log_completions_every_n_steps=1,
                         tis_cap=2.0, dtype="float32")
    trainer = tiny_trainer(tmp_path, max_steps=2)
    trainer.fit(module, tiny_data())
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0])))
    logged = [r for r in rows if r.get("episode/turns_mean")]
    assert len(logged) == 2
    for key in ("episode/turns_mean", "episode/model_tokens_mean", "episode/env_tokens_mean", "episode/truncated",
                "episode/env_errors", "episode/env_timeouts", "episode/env_time_s", "train/loss", "credit/teacher_rows"):
        assert logged[-1][key] != "", key
    assert float(logged[-1]["episode/turns_mean"]) == 2.0 and float(logged[-1]["episode/env_tokens_mean"]) > 0
    # the sampler's and the trainer's log-probs compared at the model's tokens (TIS on): they agree
    assert all(float(r["rollout/logprob_mismatch_max"]) < 1e-3 for r in logged)
    # the credit page greys out the environment's tokens (the rendered observation) and colours the model's by f
    page = open(os.path.join(trainer.log_dir, "credit_heatmap.html")).read()
    grey = re.findall(r'<span title="environment"[^>]*>([^<]*)</span>', page)
    assert "obs1" in "".join(grey) and '<span title="f=' in page
    assert not re.search(r'<span title="f=[^"]*"[^>]*>obs', page)


def test_sampler_statistics_add_up_over_turns_where_they_count_and_not_where_they_are_per_call():
    from scgrpo.envs.runner import add_engine_stats

    total: dict = {}
    add_engine_stats(total, {"rollout/decode_steps": 10.0, "rollout/prefills": 1.0, "rollout/slots": 8.0,
                             "rollout/slot_use": 0.5, "rollout/compiled": 1.0})
    add_engine_stats(total, {"rollout/decode_steps": 30.0, "rollout/prefills": 1.0, "rollout/slots": 4.0,
                             "rollout/slot_use": 0.9, "rollout/compiled": 1.0})
    assert total["rollout/decode_steps"] == 40.0 and total["rollout/prefills"] == 2.0
    assert total["rollout/slots"] == 8.0 and total["rollout/compiled"] == 1.0
    assert total["rollout/slot_use"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)


def test_a_turn_cut_by_the_budget_keeps_its_share_of_the_sampling_entropy(module):
    _, whole = play(module, Scripted(turns=1), EpisodeSettings(max_turns=1, max_episode_tokens=64))
    _, cut = play(module, Scripted(turns=1), EpisodeSettings(max_turns=1, max_episode_tokens=3))
    assert (cut.completion_mask.sum(1) == 3).all() and (whole.completion_mask.sum(1) > 3).all()
    # the same draws (same seed): the cut episodes keep 3 of each turn's tokens' share of its entropy
    share = 3 / whole.completion_mask.sum(1)
    assert torch.allclose(cut.entropy_sum, whole.entropy_sum * share, rtol=1e-5)


def test_dapo_over_episodes_counts_the_faults_of_every_sampling_round(tiny_model_dir, tmp_path):
    from scgrpo.objectives import DAPO

    class Broken(Scripted):
        def step(self, action):
            raise RuntimeError("broken")

    module = tiny_module(tiny_model_dir, environment=Broken(), objective=DAPO(max_sampling_rounds=2),
                         episodes=EpisodeSettings(max_turns=2, max_episode_tokens=48))
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(module, tiny_data())
    (row,) = [r for r in csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0]))
              if r.get("episode/turns_mean")]
    rounds = float(row["dapo/extra_rounds"])
    assert rounds == 2  # every episode faults: reward 0 everywhere, no mixed group, so DAPO samples every round
    assert float(row["rollout/sampled"]) == 16 * 3
    assert float(row["episode/env_errors"]) == 16 * 3  # the faults of the extra rounds are counted too


def test_a_first_observation_of_chat_messages_is_rendered_with_its_own_system_message(module):
    """reset may return the opening messages (TRL's format); they go through the same rendering as a dataset's
    prompt of messages, and a chat row reaches the environment as it is."""
    opening = [{"role": "system", "content": "You play a game."}]

    class Chatty(Scripted):
        def reset(self, row, seed):
            super().reset(row, seed)
            return [*opening, *row["question"]]

    rows = [{"id": "c1", "question": [{"role": "user", "content": "Start one."}], "answer": 1},
            {"id": "c2", "question": [{"role": "user", "content": "Start two."}], "answer": 2}]
    tok = module.tokenizer
    _, ep = play(module, Chatty(turns=2), rows=rows)
    assert ep.questions[0] == [*opening, *rows[0]["question"]] and ep.questions[2] == [*opening, *rows[1]["question"]]
    for i in (0, 2):
        prompt = tok.decode(ep.prompt_ids[i][ep.prompt_mask[i].bool()])
        expected = tok.apply_chat_template(ep.questions[i], tokenize=False, add_generation_prompt=True)
        assert prompt == expected and "You play a game." in prompt
    assert ep.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
