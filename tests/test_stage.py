"""The rollout stage (``scgrpo/stage.py``): a step's rollouts from its prompts to their rewards, on stand-ins for the
policy and the data (the model's own sampling is tested in tests/rollout and tests/envs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scgrpo.errors import InputError
from scgrpo.rollout.settings import Generated
from scgrpo.rollout.types import PromptBatch, RolloutBatch, RolloutStats
from scgrpo.objectives import DAPO
from scgrpo.stage import (DynamicSampling, RewardsFailed, RolloutStage, check_reward_failure_steps, completion_lengths,
                          concat_rollouts, mixed_groups, run_verifier, verified_rollouts)
from scgrpo.verifiers import RewardFunctions, Verifier, VerifierRunner
from scgrpo.verifiers.base import VerificationResult
from tests.helpers import tiny_module
from tests.test_objectives_in_training import _rollouts
from tests.verifiers.helpers import ParityVerifier, RaisingVerifier


class Scripted:
    """A stand-in policy: each prompt's completions are ``texts[prompt]`` (one token per character), in turn."""

    def __init__(self, texts: dict[str, list[str]], states: bool = False) -> None:
        self.texts, self.states, self.calls = texts, states, []
        self.tokenizer = SimpleNamespace(pad_token_id=0)

    def format_prompts(self, questions):
        return [f"<{q}>" for q in questions]

    def sample(self, prompts, num_samples, greedy=False, temperature=None, states=False):
        self.calls.append((prompts, num_samples, states))
        texts = [self.texts[p[1:-1]][k] for p in prompts for k in range(num_samples)]
        width = max(len(t) for t in texts)
        ids = torch.tensor([[ord(ch) for ch in t] + [0] * (width - len(t)) for t in texts])
        mask = (ids != 0).float()
        n = len(texts)
        hidden = torch.zeros(n, width, 2) if (states and self.states) else None
        return Generated(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                         completion_ids=ids, completion_mask=mask, truncated=torch.zeros(n, dtype=torch.bool),
                         completions=texts, stats={"rollout/slots": float(n)}, states=hidden)

    def sync(self):
        pass


def _batch(*questions):
    return PromptBatch(ids=list(questions), questions=list(questions), answers=[0] * len(questions))


def test_collect_samples_g_of_each_prompt_and_verifies_them():
    policy = Scripted({"a": ["xx", "x"], "b": ["xxxx", "xxx"]})
    stage = RolloutStage(policy, 2, VerifierRunner(ParityVerifier()))
    rollouts = stage.collect(_batch("a", "b"))
    assert rollouts.sample_ids == ["a", "a", "b", "b"] and rollouts.completions == ["xx", "x", "xxxx", "xxx"]
    assert rollouts.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # even lengths score 1
    stats = rollouts.stats
    assert stats.sampled == 4.0 and stats.sampler == {"rollout/slots": 4.0}
    assert stats.verifier_errors == 0.0 and stats.verifier_timeouts == 0.0 and stats.generation_s >= 0.0
    assert stats.extra_rounds is None and "dapo/extra_rounds" not in stats.metrics()  # (no dynamic sampling)
    assert verified_rollouts(SimpleNamespace(rollouts=rollouts)) is rollouts


def test_a_batch_without_verified_rollouts_is_refused_before_the_step():
    with pytest.raises(RuntimeError, match="RolloutCallback must run"):
        verified_rollouts(_batch("a"))


def test_steps_whose_every_reward_failed_stop_the_run_at_the_limit_and_a_good_step_resets_the_count():
    policy = Scripted({"a": ["x", "xx"]})
    failing = RolloutStage(policy, 2, VerifierRunner(RaisingVerifier()), max_reward_failure_steps=3)
    for _ in range(2):
        rollouts = failing.collect(_batch("a"))
        assert rollouts.stats.verifier_errors == 2.0  # this step's errors, not the run's
    assert failing.reward_failure_steps == 2
    with pytest.raises(RewardsFailed, match="every reward of the last 3 steps failed .* raise model.max_reward_failure"):
        failing.collect(_batch("a"))
    failing.count_reward_failures(False, [])
    assert failing.reward_failure_steps == 0
    never = RolloutStage(policy, 2, VerifierRunner(RaisingVerifier()), max_reward_failure_steps=0)
    for _ in range(5):
        never.collect(_batch("a"))  # 0: never stops
    with pytest.raises(ValueError, match="max_reward_failure_steps must be >= 0"):
        check_reward_failure_steps(-1)


def test_sampler_states_are_asked_for_and_their_absence_said_once(caplog):
    policy = Scripted({"a": ["x", "xx"]}, states=False)
    stage = RolloutStage(policy, 2, VerifierRunner(ParityVerifier()), states=True)
    with caplog.at_level("INFO", logger="scgrpo.stage"):
        first, second = stage.collect(_batch("a")), stage.collect(_batch("a"))
    assert policy.calls[0][2] is True and first.student_states is None and second.student_states is None
    assert caplog.text.count("carry no sampler states") == 1
    kept = RolloutStage(Scripted({"a": ["x", "xx"]}, states=True), 2, VerifierRunner(ParityVerifier()), states=True)
    assert kept.collect(_batch("a")).student_states.shape == (2, 2, 2)


def test_episodes_come_rewarded_and_skip_the_verifier():
    class Episodes:
        def run(self, policy, rows, g):
            out = policy.sample(policy.format_prompts([r["question"] for r in rows]), g)
            n = len(out.completions)
            return SimpleNamespace(**vars(out), questions=[r["question"] for r in rows for _ in range(g)],
                                   env_mask=torch.zeros_like(out.completion_mask), rewards=torch.full((n,), 0.5),
                                   infos=[{"episode": True}] * n)

    stage = RolloutStage(Scripted({"a": ["x", "xx"]}), 2, VerifierRunner(RaisingVerifier()), Episodes())
    rollouts = stage.collect(_batch("a"))
    assert rollouts.rewards.tolist() == [0.5, 0.5] and rollouts.infos == [{"episode": True}] * 2
    assert rollouts.stats.verifier_errors == 0.0 and stage.reward_failure_steps == 0  # (the verifier never ran)


def test_the_verified_rows_are_those_at_the_threshold_with_their_tokens():
    policy = Scripted({"a": ["xx", "x"]})
    rollouts = RolloutStage(policy, 2, VerifierRunner(ParityVerifier())).collect(_batch("a"))
    rows = RolloutStage(policy, 2, None).verified_rows(rollouts, 1.0)
    assert rows == [("a", [ord("x")] * 2, "xx", 1.0)]


def test_completion_lengths_of_single_turns_and_of_episodes():
    assert completion_lengths(None, 48) == (48, 48)
    runner = SimpleNamespace(settings=SimpleNamespace(max_episode_tokens=256))
    assert completion_lengths(runner, 48) == (256, 256 + 48)  # (a last turn may sample past the budget)


class _AnswerFree:
    def answer_fault(self):
        return "rows.jsonl has no answer column"

    def rows(self, split):
        return [{"columns": {"topic": "x"}}]

    def splits(self):
        return ["train"]


def test_the_run_verifier_is_the_given_one_or_the_datas_and_must_fit_the_data():
    given = ParityVerifier()
    assert run_verifier(given, None, None, False) is given
    data = SimpleNamespace(default_verifier=lambda: given)
    assert run_verifier(None, data, None, False) is given
    with pytest.raises(ValueError, match="no verifier given"):
        run_verifier(None, None, None, False)

    class Answers(Verifier):
        def verify(self, completion, answer, question=""):
            return VerificationResult(1.0)

    with pytest.raises(InputError, match="no answer column .Answers scores against them"):
        run_verifier(Answers(), SimpleNamespace(source=_AnswerFree()), None, False)
    with pytest.raises(InputError, match="the objective's teacher reads them"):
        run_verifier(Answers(), SimpleNamespace(source=_AnswerFree()), "DoorsEnv", True)
    assert run_verifier(Answers(), SimpleNamespace(source=_AnswerFree()), "DoorsEnv", False) is not None  # episodes
    rewards = RewardFunctions([lambda completions, **kw: [1.0] * len(completions)])
    with pytest.raises(InputError, match="episodes in DoorsEnv, which rewards them itself"):
        run_verifier(rewards, None, "DoorsEnv", False)


def test_stats_of_rounds_add_up_and_those_a_round_lacks_keep_the_first():
    first = RolloutBatch(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), torch.ones(1, 2),
                         torch.ones(1, 2), torch.zeros(1, dtype=torch.bool), 1, ["a"], ["q"], [0], ["x"],
                         rewards=torch.ones(1), stats=RolloutStats(sampled=2.0, verification_s=0.5))
    assert first.stats.plus(RolloutStats(sampled=3.0)).sampled == 5.0
    assert first.stats.plus(RolloutStats(sampled=3.0)).verification_s == 0.5


class _ScriptedData:
    """Extra batches whose groups come out mixed or uniform as scripted (via the ParityVerifier offset)."""

    def __init__(self):
        self.calls = 0

    def extra_batch(self):
        self.calls += 1
        return PromptBatch(ids=[f"e{self.calls}"], questions=["x"], answers=[0])


def test_dynamic_sampling_keeps_only_mixed_groups_and_stops_at_its_cap(tiny_model_dir, monkeypatch):
    torch.manual_seed(0)
    module = tiny_module(tiny_model_dir, objective=DAPO(max_sampling_rounds=2))
    module.configure_model()
    stage = RolloutStage(module.actor, 4, None, dynamic_sampling=DynamicSampling(max_rounds=2))
    rollouts = _rollouts(module, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # group b is uniform
    rollouts.stats = RolloutStats(sampled=8.0)
    calls = []

    def fake_score(rollouts):  # extra groups are always uniform: the loop must stop at its cap
        calls.append(1)
        rollouts.rewards = torch.ones(len(rollouts.completions))

    monkeypatch.setattr(stage, "score", fake_score)
    kept = stage.resample_equal_groups(rollouts, _ScriptedData().extra_batch)
    assert kept.num_groups == 1 and kept.sample_ids == ["a"] * 4
    assert kept.stats.extra_rounds == 2 and len(calls) == 2
    assert kept.stats.sampled == 8 + 2 * 4  # every drawn rollout counts, kept or dropped

    rollouts = _rollouts(module, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    rollouts.stats = RolloutStats(sampled=8.0)

    def mixed_score(rollouts):
        rollouts.rewards = torch.tensor([float(i % 2) for i in range(len(rollouts.completions))])

    monkeypatch.setattr(stage, "score", mixed_score)
    kept = stage.resample_equal_groups(rollouts, _ScriptedData().extra_batch)
    assert kept.num_groups == 2 and kept.stats.extra_rounds == 1 and kept.stats.kept_groups == 2
    assert kept.stats.sampled == 12
    assert len(mixed_groups(kept)) == 8  # every kept group has mixed rewards


def test_concat_rollouts_repads_prompts_left_and_completions_right(tiny_model_dir):
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    a = _rollouts(module, [1.0] * 8)
    b = a.select(torch.arange(4))
    b.prompt_ids, b.prompt_mask = b.prompt_ids[:, 2:], b.prompt_mask[:, 2:]
    b.completion_ids, b.completion_mask = b.completion_ids[:, :2], b.completion_mask[:, :2]
    merged = concat_rollouts([a, b], pad_id=2)
    assert merged.prompt_ids.shape == (12, a.prompt_ids.shape[1])
    assert merged.completion_ids.shape == (12, a.completion_ids.shape[1])
    assert torch.equal(merged.prompt_ids[8:, 2:], b.prompt_ids) and (merged.prompt_mask[8:, :2] == 0).all()
    assert torch.equal(merged.completion_ids[8:, :2], b.completion_ids) and (merged.completion_mask[8:, 2:] == 0).all()


def test_a_run_stage_asks_at_each_rollout_whether_to_keep_the_sampler_states():
    """``for_run`` wires the objective's teacher, the generation settings, the device and the policy's pass options
    into the choice, read at each rollout: a policy whose teacher passes stop sharing the student's forward after the
    stage was made (a benchmark's case, set once the policy is loaded) keeps the sampler's states from then on."""
    from scgrpo.objectives import GRPO, SCGRPO
    from scgrpo.policy import PassOptions
    from scgrpo.rollout.engine import GenerationSettings

    policy = Scripted({"a": ["x", "xx"]})
    policy.passes = PassOptions()
    generation = GenerationSettings(num_generations=2, max_new_tokens=128)  # student_states "auto"
    gpu = torch.device("cuda", 0)
    stage = RolloutStage.for_run(policy, generation, None, None, SCGRPO(), 3, gpu)
    assert not stage.states  # (the student's rows ride in the teacher's forward at this length)
    policy.passes = PassOptions(shared_teacher_passes=False)
    assert stage.states
    assert not RolloutStage.for_run(policy, generation, None, None, GRPO(), 3, gpu).states  # no teacher
    assert not RolloutStage.for_run(policy, generation, None, None, SCGRPO(), 3, torch.device("cpu")).states
    episodes = SimpleNamespace(settings=SimpleNamespace(max_episode_tokens=64))
    assert not RolloutStage.for_run(policy, generation, None, episodes, SCGRPO(), 3, gpu).states
    dapo = RolloutStage.for_run(policy, generation, None, None, DAPO(max_sampling_rounds=5), 3, gpu)
    assert dapo.dynamic_sampling.max_rounds == 5 and stage.dynamic_sampling is None


def test_a_gpu_out_of_memory_in_sampling_is_one_error_of_the_rollout_phase_and_verification_is_left_alone():
    from scgrpo.errors import GPUOutOfMemory
    from scgrpo.oom import out_of_memory_as_error

    module = SimpleNamespace(device=torch.device("cpu"), budget=None, memory_budget_gib=None, micro_batch_size=None,
                             gradient_checkpointing=False, _trainer=None, global_step=0)
    policy = Scripted({"a": ["x", "xx"]})

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    stage = RolloutStage(policy, 2, VerifierRunner(ParityVerifier()), guard=lambda: out_of_memory_as_error("rollout", module))
    policy.sample = out_of_memory
    with pytest.raises(GPUOutOfMemory, match="in the rollout phase"):
        stage.collect(_batch("a"))

    class Large(Verifier):  # (a reward model on the card: its own memory error, as before the stage)
        def verify_batch(self, completions, answers, questions):
            raise torch.OutOfMemoryError("CUDA out of memory in the reward model")

        def verify(self, completion, answer, question=""):
            return VerificationResult(0.0)

    stage = RolloutStage(Scripted({"a": ["x", "xx"]}), 2, VerifierRunner(Large()),
                         guard=lambda: out_of_memory_as_error("rollout", module))
    rollouts = stage.collect(_batch("a"))  # the runner scores a failed batch 0 and counts it
    assert rollouts.rewards.tolist() == [0.0, 0.0] and rollouts.stats.verifier_errors == 2.0


def test_concatenated_rounds_keep_every_field_of_every_row_padded_where_each_belongs():
    """Two rounds of different widths: prompts re-padded on the left (mask 0), completions and their per-token fields
    on the right (the pad id; 0 for masks, log-probs and the environment's mask), the sampler's states along their
    columns; per-row fields in order; a field one round lacks is None; the stats added up."""
    def part(n, tp, c, base, with_states=True):
        return RolloutBatch(
            prompt_ids=torch.full((n, tp), base), prompt_mask=torch.ones(n, tp, dtype=torch.long),
            completion_ids=torch.full((n, c), base + 1), completion_mask=torch.ones(n, c),
            truncated=torch.tensor([True] * n), group_size=2, sample_ids=[f"s{base}"] * n, questions=[f"q{base}"] * n,
            answers=[base] * n, completions=[f"c{base}"] * n, rewards=torch.full((n,), float(base)),
            infos=[{"row": base}] * n, entropy_sum=torch.full((n,), 0.5 * base),
            sampler_logprobs=torch.full((n, c), -1.0 * base), env_mask=torch.ones(n, c),
            columns=[{"col": base}] * n, student_states=torch.full((n, c, 3), float(base)) if with_states else None,
            stats=RolloutStats(sampled=float(n), generation_s=1.0, sampler={"episode/env_errors": 1.0}))

    a, b = part(2, 3, 4, 10), part(2, 1, 2, 20)
    merged = concat_rollouts([a, b], pad_id=7)
    assert merged.prompt_ids[2:].tolist() == [[7, 7, 20]] * 2 and merged.prompt_mask[2:].tolist() == [[0, 0, 1]] * 2
    assert merged.completion_ids[2:].tolist() == [[21, 21, 7, 7]] * 2 and merged.completion_ids[:2].tolist() == [[11] * 4] * 2
    assert merged.completion_mask[2:].tolist() == [[1.0, 1.0, 0.0, 0.0]] * 2
    assert merged.sampler_logprobs[2:].tolist() == [[-20.0, -20.0, 0.0, 0.0]] * 2
    assert merged.env_mask[2:].tolist() == [[1.0, 1.0, 0.0, 0.0]] * 2
    assert merged.student_states.shape == (4, 4, 3) and (merged.student_states[2:, :2] == 20.0).all()
    assert merged.student_states[:2].eq(10.0).all() and merged.truncated.tolist() == [True] * 4
    assert merged.sample_ids == ["s10"] * 2 + ["s20"] * 2 and merged.questions == ["q10"] * 2 + ["q20"] * 2
    assert merged.answers == [10, 10, 20, 20] and merged.completions == ["c10"] * 2 + ["c20"] * 2
    assert merged.rewards.tolist() == [10.0, 10.0, 20.0, 20.0] and merged.entropy_sum.tolist() == [5.0, 5.0, 10.0, 10.0]
    assert merged.infos == [{"row": 10}] * 2 + [{"row": 20}] * 2 and merged.columns == [{"col": 10}] * 2 + [{"col": 20}] * 2
    assert merged.group_size == 2 and merged.stats.sampled == 4.0 and merged.stats.generation_s == 2.0
    assert merged.stats.sampler == {"episode/env_errors": 2.0}
    assert concat_rollouts([a, part(2, 1, 2, 20, with_states=False)], pad_id=7).student_states is None


def test_dynamic_sampling_times_each_round_and_says_when_it_stops_short(tiny_model_dir, monkeypatch, caplog):
    module = tiny_module(tiny_model_dir, objective=DAPO(max_sampling_rounds=2))
    module.configure_model()
    stage = RolloutStage(module.actor, 4, None, dynamic_sampling=DynamicSampling(max_rounds=2))
    rollouts = _rollouts(module, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    rollouts.stats = RolloutStats(sampled=8.0, generation_s=0.0)
    monkeypatch.setattr(stage, "score", lambda r: setattr(r, "rewards", torch.ones(len(r.completions))))
    with caplog.at_level("DEBUG", logger="scgrpo.stage"):
        kept = stage.resample_equal_groups(rollouts, _ScriptedData().extra_batch)
    assert kept.stats.generation_s > 0.0 and kept.stats.metrics()["dapo/kept_groups"] == 1.0
    assert "dynamic sampling stopped at 1 of 2 groups after 2 extra rounds" in caplog.text
