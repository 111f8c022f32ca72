"""Plays episodes: all episodes of a batch advance together, one model turn at a time.

Each turn decodes the reply of every live episode in one call of the sampler (the compact engine, as for single
completions), then the environments answer, in parallel threads and each within its time limit, and their
observations are rendered by the chat template and appended as token ids. The history is never decoded and
tokenized again: the ids the policy is trained on are the ids it sampled and read.

The host's own work in a turn is kept to a few passes over the batch: the sampler's outputs are read into lists in
one copy per tensor, the turn's observations are tokenized in one call (each distinct text once: a group's episodes
often read the same), the histories are padded in one array; the environment calls are taken in order by a few
reused threads (:meth:`CallPool.call_all`), so that a call that returns at once costs no hand-over to a thread of its own.

Between turns the KV cache is re-filled by one prefill of each live history (the sampler's workspace, its cache
and CUDA graphs are sized once for the whole episode batch and reused by every turn). ``docs/envs.md`` gives the
measured cost of that prefill against the decode steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from scgrpo.chat import prompt_fault, prompt_key
from scgrpo.distributed import all_reduce
from scgrpo.envs.calls import ERROR, OK, TIMEOUT, CallPool
from scgrpo.envs.base import Action, Environment, EpisodeSettings, StepResult

log = logging.getLogger(__name__)

class ChatTurns:
    """Token ids of an environment's observation, as the chat template renders it after a model turn.

    The template is rendered once with sentinels: what follows an assistant message's content (its end-of-turn
    marker, which the model usually sampled itself as its end-of-sequence token), then a message of the
    observation's role and the next assistant header. Without a chat template the observation sits between blank
    lines."""

    SENTINEL = "\x00OBSERVATION\x00"

    def __init__(self, tokenizer, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.after_turn, self.before, self.after = "\n\n", "", "\n\n"
        if getattr(tokenizer, "chat_template", None):
            reply = "\x00REPLY\x00"
            messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": reply},
                        {"role": role, "content": self.SENTINEL}]
            # one rendering: templates may show a last assistant turn otherwise (Qwen3's empty thinking block)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if reply not in text or self.SENTINEL not in text.split(reply, 1)[1]:
                raise ValueError(f"the chat template does not render a {role!r} message after an assistant turn; set "
                                 "the environment's observation_role to a role it renders")
            between, self.after = text.split(reply, 1)[1].split(self.SENTINEL, 1)
            self.after_turn, self.before = between, ""  # end of the model's turn, then the observation's header

    def ids(self, observation: str, ended_turn: Optional[str]) -> list[int]:
        """The observation's ids; ``ended_turn``: the text of the end-of-sequence token the model's turn ended
        with (None: cut at the turn's token limit), which the template's end-of-turn text then does not repeat."""
        return self.ids_many([observation], [ended_turn])[0]

    def ids_many(self, observations: Sequence[str], ended_turns: Sequence[Optional[str]]) -> list[list[int]]:
        """:meth:`ids` of each observation (after the turn that ended with the matching ``ended_turns``), in one
        call of the tokenizer, each distinct text tokenized once (the episodes of a group often read the same)."""
        texts = []
        for observation, ended_turn in zip(observations, ended_turns):
            head = self.after_turn
            if ended_turn and head.startswith(ended_turn):
                head = head[len(ended_turn):]
            texts.append(head + self.before + observation + self.after)
        distinct = list(dict.fromkeys(texts))
        ids = dict(zip(distinct, self.tokenizer(distinct, add_special_tokens=False)["input_ids"] if distinct else []))
        return [list(ids[text]) for text in texts]


@dataclass
class Episode:
    """One episode while it runs: its environment, its tokens after the first prompt, and how it ended."""

    env: Optional[Environment]
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    model: list[float] = field(default_factory=list)  # 1 where the model sampled the token
    logprobs: list[float] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)  # the model turn of each token (-1: the environment's)
    entropy: float = 0.0
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)  # the reward of the step after each model turn
    turns: int = 0
    done: bool = False
    truncated: bool = False
    fault: Optional[str] = None  # "error" or "timeout"
    transcript: list[str] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)


@dataclass
class Episodes:
    """A batch of finished episodes (``N`` rows, each prompt's ``num_samples`` adjacent), as tensors."""

    questions: list[Any]  # [N] the first observation (the episode's user turn: text, or chat messages)
    prompt_ids: Tensor  # [N, Tp] left-padded
    prompt_mask: Tensor  # [N, Tp]
    completion_ids: Tensor  # [N, C] right-padded: the model's turns and the observations
    completion_mask: Tensor  # [N, C] float, the model's tokens
    env_mask: Tensor  # [N, C] float, the environment's tokens
    truncated: Tensor  # [N] bool, ended by the turn limit or the token budget
    rewards: Tensor  # [N] float, the sum of the environment's rewards (0 after a fault)
    completions: list[str]  # [N] transcripts
    infos: list[dict]  # [N] turns, the environment's infos, the fault if any
    entropy_sum: Optional[Tensor] = None  # [N] summed sampling entropy over the model's tokens
    sampler_logprobs: Optional[Tensor] = None  # [N, C]
    turn_rewards: Optional[Tensor] = None  # [N, max_turns] the reward after each model turn (0 after a fault)
    turn_index: Optional[Tensor] = None  # [N, C] long, the model turn of each model token, -1 elsewhere
    stats: dict[str, float] = field(default_factory=dict)


def transcript(episode: Episode) -> str:
    return "\n\n".join(episode.transcript)


class EpisodeRunner:
    """Plays ``num_samples`` episodes of each row of a batch with a policy (see the module docstring).

    Args:
        environment: the template environment; each episode plays on its own :meth:`~Environment.spawn`.
        settings: turn limit, token budget, time limit of an environment call, threads.
        pool: the threads that run the environment's calls (None: a pool of its own; tests pass one with a clock).
    """

    def __init__(self, environment: Environment, settings: EpisodeSettings = EpisodeSettings(),
                 pool: Optional[CallPool] = None) -> None:
        self.environment, self.settings = environment, settings
        self.pool = pool if pool is not None else CallPool()  # the threads of the environment's calls
        self.errors = self.timeouts = 0  # over the run
        self._logged: set[str] = set()
        self._chat: Optional[ChatTurns] = None

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s if self.settings.timeout_s is not None else float(self.environment.timeout_s)

    def _calls(self, calls: Sequence[Callable[[], Any]], episodes: Sequence[Episode], what: str, stats: dict) -> list:
        """Runs environment calls; a fault ends its episode without a reward and is counted and logged once."""
        start = time.perf_counter()
        results = self.pool.call_all(calls, self.timeout_s, self.settings.max_workers)
        stats["episode/env_time_s"] = stats.get("episode/env_time_s", 0.0) + time.perf_counter() - start
        values = []
        for (status, value), episode in zip(results, episodes):
            if status == OK:
                values.append(value)
                continue
            name = type(self.environment).__name__
            if status == TIMEOUT:
                self.timeouts += 1
                stats["episode/env_timeouts"] = stats.get("episode/env_timeouts", 0.0) + 1
                message = f"{name}.{what} ran past {self.timeout_s:g}s"
            else:
                self.errors += 1
                stats["episode/env_errors"] = stats.get("episode/env_errors", 0.0) + 1
                message = f"{name}.{what} raised {type(value).__name__}: {value}"
            self._end_with_fault(episode, status, message)
            values.append(None)
        return values

    def _end_with_fault(self, episode: Episode, status: str, message: str) -> None:
        episode.fault, episode.done, episode.reward = status, True, 0.0
        episode.turn_rewards = [0.0] * len(episode.turn_rewards)
        episode.infos.append({"env_error": message})
        if status not in self._logged:
            self._logged.add(status)
            fate = ("has no reward: it leaves its group's statistics and the loss (rollout/excluded)"
                    if self.settings.on_fault == "exclude" else "ends with reward 0")
            log.warning("%s; the episode %s (further ones are counted under episode/env_%ss, not logged)", message,
                        fate, "timeout" if status == TIMEOUT else "error")
        if status != TIMEOUT:  # a hung environment may still be inside its own code
            _close(episode.env)

    def run(self, policy, rows: Sequence[dict[str, Any]], num_samples: int, greedy: bool = False,
            temperature: Optional[float] = None, seed: Optional[int] = None) -> Episodes:
        """``num_samples`` episodes of each of ``rows`` (``{"id", "question", "answer", "columns"}``) with ``policy`` (a
        :class:`~scgrpo.policy.Policy`: ``tokenizer``, ``format_prompts``, ``eval_mode``, ``one_model_state``,
        ``sample_ids``). The episodes of one row share the environment seed (a group starts from one state), made from the row's id and ``seed`` (None: drawn
        from torch's generator, so a seeded run repeats; evaluation passes 0, so every run meets the same episodes)."""
        settings, tok = self.settings, policy.tokenizer
        stats = {"episode/env_errors": 0.0, "episode/env_timeouts": 0.0, "episode/env_time_s": 0.0}
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)))
        expanded = [row for row in rows for _ in range(num_samples)]
        episodes = [Episode(env=None) for _ in expanded]
        spawned = self._calls([self.environment.spawn for _ in expanded], episodes, "spawn", stats)
        for episode, env in zip(episodes, spawned):
            episode.env = env
        live = [e for e in episodes if not e.done]
        firsts = self._calls([_reset_call(e.env, row, row_seed(row, seed)) for e, row in zip(episodes, expanded)
                              if not e.done], live, "reset", stats)
        observations = {id(e): obs for e, obs in zip(live, firsts)}
        questions = []
        for episode, row in zip(episodes, expanded):
            first = observations.get(id(episode))
            fault = "no first observation" if episode.done else prompt_fault(first)
            if not episode.done and fault is not None:
                self._junk(episode, f"reset returned {type(first).__name__} ({fault}), not the first observation's "
                           "text or messages", stats)
            questions.append(first if fault is None else row.get("question") or "")
        # a group's episodes mostly start from one observation: each distinct one is rendered and tokenized once
        keys = [prompt_key(q) for q in questions]
        distinct = {key: q for key, q in zip(keys, questions)}
        prompts = dict(zip(distinct, tok(policy.format_prompts(list(distinct.values())),
                                         add_special_tokens=False)["input_ids"]))
        for episode, key in zip(episodes, keys):
            episode.prompt = list(prompts[key])
        eos_text = {i: tok.decode([i]) for i in _eos_ids(policy)}
        if self._chat is None:
            self._chat = ChatTurns(tok, self.environment.observation_role)
        reserve = (len(episodes), max(len(e.prompt) for e in episodes) + settings.max_episode_tokens
                   + policy.generation.max_new_tokens)
        engine_stats: dict[str, float] = {}
        # once for the whole batch: eval mode (each turn's sampler then leaves the modes as they are), and the
        # compact forward's support checked once per length
        with policy.eval_mode(), policy.one_model_state():
            self._turns(policy, episodes, greedy, temperature, reserve, eos_text, engine_stats, stats)
        for episode in episodes:
            if not episode.done:
                episode.done = episode.truncated = True
                _close(episode.env)
        out = self._tensors(policy, episodes, questions, greedy)
        out.stats.update(engine_stats)
        out.stats.update(stats)
        n = max(len(episodes), 1)
        model_tokens = out.completion_mask.sum(1)
        out.stats.update({"episode/turns_mean": sum(e.turns for e in episodes) / n,
                          "episode/model_tokens_mean": float(model_tokens.mean()) if len(episodes) else 0.0,
                          "episode/env_tokens_mean": float(out.env_mask.sum(1).mean()) if len(episodes) else 0.0,
                          "episode/truncated": sum(e.truncated for e in episodes) / n})
        return out

    def _turns(self, policy, episodes: list[Episode], greedy: bool, temperature: Optional[float], reserve,
               eos_text: dict[int, str], engine_stats: dict, stats: dict) -> None:
        """The model's turns and the environments' answers until every episode ended or the turn limit."""
        settings, tok = self.settings, policy.tokenizer
        for turn in range(settings.max_turns):
            # an episode that faulted at reset still takes its first turn (every row has model tokens), then ends
            going = [e for e in episodes if not e.done or (turn == 0 and e.fault is not None)]
            if getattr(policy, "sharded", False):  # each sampler call gathers the weights: every rank makes as many
                if all_reduce([float(bool(going))], "max", policy.device)[0] == 0:
                    break
                if not going:  # this rank's episodes all ended: it decodes one stand-in row and drops it
                    self._decode(policy, episodes[:1], greedy, temperature, reserve)
                    continue
            elif not going:
                break
            generated = self._decode(policy, going, greedy, temperature, reserve)
            add_engine_stats(engine_stats, generated.stats)
            acting, actions = [], []
            for episode, ended in zip(going, self._append_turns(going, generated, tok, eos_text)):
                if episode.done:  # a fault at reset, or the token budget
                    continue
                acting.append(episode)
                actions.append((episode.transcript[-1], ended))
            results = self._calls([_step_call(e.env, text) for e, (text, _) in zip(acting, actions)], acting,
                                  "step", stats)
            reading, observations, ended_turns = [], [], []  # the episodes that go on, with their observations
            for episode, (text, ended), result in zip(acting, actions, results):
                if episode.done:
                    continue
                if not isinstance(result, StepResult) or not _finite(result.reward) or not isinstance(result.info, dict):
                    self._junk(episode, f"step returned {_describe(result)}, not a StepResult with a finite reward "
                               "and a dict of info", stats)
                    continue
                episode.reward += float(result.reward)
                episode.turn_rewards[-1] += float(result.reward)
                episode.infos.append(dict(result.info))
                if result.done:
                    episode.done = True
                    _close(episode.env)
                    continue
                if not isinstance(result.observation, str):
                    self._junk(episode, f"step returned a {type(result.observation).__name__} observation, not text",
                               stats)
                    continue
                reading.append(episode)
                observations.append(result.observation)
                ended_turns.append(ended)
            if turn + 1 >= settings.max_turns:  # no room for another model turn, whatever the observations
                for episode in reading:
                    episode.done = episode.truncated = True
                    _close(episode.env)
                continue
            # every observation of the turn rendered and tokenized at once
            for episode, text, ids in zip(reading, observations, self._chat.ids_many(observations, ended_turns)):
                if len(episode.tokens) + len(ids) >= settings.max_episode_tokens:
                    episode.done = episode.truncated = True  # no room for another model turn
                    _close(episode.env)
                    continue
                episode.tokens += ids
                episode.model += [0.0] * len(ids)
                episode.logprobs += [0.0] * len(ids)
                episode.turn_of += [-1] * len(ids)
                episode.transcript.append(f"[{self.environment.observation_role}] {text}")

    def _junk(self, episode: Episode, message: str, stats: dict) -> None:
        self.errors += 1
        stats["episode/env_errors"] = stats.get("episode/env_errors", 0.0) + 1
        self._end_with_fault(episode, ERROR, f"{type(self.environment).__name__}: {message}")

    def _decode(self, policy, going: list[Episode], greedy: bool, temperature: Optional[float], reserve):
        """One turn of every episode in ``going``: their histories, left-padded, through the sampler."""
        pad = policy.tokenizer.pad_token_id
        histories = [e.prompt + e.tokens for e in going]
        lengths = [len(h) for h in histories]
        width = max(lengths)
        ids = _rows([[pad] * (width - len(h)) + h for h in histories], (len(going), width), np.int64)
        mask = _filled(lengths, width, left=True).long()
        device = policy.device
        generated = policy.sample_ids(ids.to(device), mask.to(device), greedy=greedy, temperature=temperature,
                                      reserve=reserve)
        # on the host in one copy each: the runner reads them row by row
        return dataclasses.replace(generated, **{name: getattr(generated, name).cpu() for name in (
            "completion_ids", "completion_mask", "truncated", "entropy_sum", "sampler_logprobs")
            if getattr(generated, name) is not None})

    def _append_turns(self, going: list[Episode], generated, tok, eos_text: dict[int, str]) -> list[Optional[str]]:
        """Books row ``k`` of ``generated`` as the next model turn of ``going[k]``, cut at the token budget; returns
        for each the text of the end-of-sequence token its turn ended with (None: cut)."""
        budget = self.settings.max_episode_tokens
        lengths = generated.completion_mask.sum(1).tolist()  # each tensor read into lists at once
        rows = generated.completion_ids.tolist()
        truncated = generated.truncated.tolist()
        logprob_rows = generated.sampler_logprobs.tolist() if generated.sampler_logprobs is not None else None
        entropies = generated.entropy_sum.tolist() if generated.entropy_sum is not None else None
        ended = []
        for k, episode in enumerate(going):
            length = int(lengths[k])
            ids = rows[k][:length]
            room = budget - len(episode.tokens)
            cut = len(ids) > room
            ids = ids[:room]
            episode.tokens += ids
            episode.model += [1.0] * len(ids)
            episode.turn_of += [episode.turns] * len(ids)
            episode.turn_rewards.append(0.0)
            episode.logprobs += logprob_rows[k][: len(ids)] if logprob_rows is not None else [0.0] * len(ids)
            if entropies is not None:  # a turn cut at the budget keeps its share (the sampler gives sums)
                episode.entropy += entropies[k] * len(ids) / max(length, 1)
            episode.turns += 1
            episode.transcript.append(tok.decode(ids, skip_special_tokens=True).strip())
            if episode.fault is not None:
                episode.done = True
            elif cut or len(episode.tokens) >= budget:
                episode.done = episode.truncated = True
                _close(episode.env)
            ended.append(eos_text.get(ids[-1]) if ids and not truncated[k] and not cut else None)
        return ended

    def _tensors(self, policy, episodes: list[Episode], questions: list[str], greedy: bool) -> Episodes:
        device, pad = policy.device, policy.tokenizer.pad_token_id
        n = len(episodes)
        tp = max((len(e.prompt) for e in episodes), default=1)
        c = max((len(e.tokens) for e in episodes), default=1)
        prompt_ids = _rows([[pad] * (tp - len(e.prompt)) + e.prompt for e in episodes], (n, tp), np.int64)
        prompt_mask = _filled([len(e.prompt) for e in episodes], tp, left=True).long()
        completion_ids = _rows([e.tokens + [pad] * (c - len(e.tokens)) for e in episodes], (n, c), np.int64)
        model = _rows([e.model + [0.0] * (c - len(e.model)) for e in episodes], (n, c), np.float32)
        # the environment's tokens: the episode's tokens the model did not sample (padding is neither)
        env = _filled([len(e.tokens) for e in episodes], c).float() - model
        logprobs = _rows([e.logprobs + [0.0] * (c - len(e.logprobs)) for e in episodes], (n, c), np.float32)
        turn_index = _rows([e.turn_of + [-1] * (c - len(e.turn_of)) for e in episodes], (n, c), np.int64)
        t = self.settings.max_turns
        turn_rewards = _rows([e.turn_rewards + [0.0] * (t - len(e.turn_rewards)) for e in episodes], (n, t), np.float32)
        infos = [{"turns": e.turns, "env": e.infos, **({"fault": e.fault} if e.fault else {})} for e in episodes]
        return Episodes(
            questions=questions,
            prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
            completion_ids=completion_ids.to(device), completion_mask=model.to(device), env_mask=env.to(device),
            truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool, device=device),
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=device),
            completions=[transcript(e) for e in episodes], infos=infos,
            entropy_sum=None if greedy else torch.tensor([e.entropy for e in episodes], device=device),
            sampler_logprobs=None if greedy else logprobs.to(device),
            turn_rewards=turn_rewards.to(device), turn_index=turn_index.to(device),
        )


def _rows(rows: list[list], shape: tuple[int, int], dtype) -> Tensor:
    """Equal-length Python rows as one CPU tensor of ``shape`` (one conversion, not one per row)."""
    return torch.from_numpy(np.array(rows, dtype=dtype).reshape(shape))


def _filled(lengths: list[int], width: int, left: bool = False) -> Tensor:
    """``[len(lengths), width]`` bool: the first ``lengths[i]`` places of row ``i`` (with ``left``, the last)."""
    places, lengths = torch.arange(width), torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
    return places >= width - lengths if left else places < lengths


ENGINE_COUNTERS = ("rollout/decode_steps", "rollout/prefills", "rollout/compactions", "rollout/graphs_recorded")
"""The sampler's statistics that add up over the turns of a batch; the others are per call (the largest is kept,
except ``rollout/slot_use``, a ratio, averaged over the turns by their decode steps)"""


def add_engine_stats(total: dict, turn: dict) -> None:
    """Books one turn's sampler statistics into the batch's ``total``."""
    steps = turn.get("rollout/decode_steps", 0.0)
    if "rollout/slot_use" in turn:
        before = total.get("rollout/decode_steps", 0.0)
        mean = total.get("rollout/slot_use", 0.0)
        total["rollout/slot_use"] = (mean * before + turn["rollout/slot_use"] * steps) / max(before + steps, 1.0)
    for key, value in turn.items():
        if key in ENGINE_COUNTERS:
            total[key] = total.get(key, 0.0) + value
        elif key != "rollout/slot_use":
            total[key] = max(total.get(key, value), value)


def row_seed(row: dict, seed: int) -> int:
    """The environment seed of a row's episodes: a stable hash of its id, mixed with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{row.get('id', '')}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _reset_call(env: Environment, row: dict, seed: int) -> Callable[[], Any]:
    return lambda: env.reset(row, seed)


def _step_call(env: Environment, text: str) -> Callable[[], Any]:
    return lambda: env.step(Action(text=text, tool_call=env.parse_tool_call(text)))


def _close(env: Optional[Environment]) -> None:
    if env is None:
        return
    try:
        env.close()
    except Exception as err:  # noqa: BLE001 - closing is best effort
        log.debug("closing %s raised %s", type(env).__name__, err)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's object whose repr raises
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _eos_ids(policy) -> list[int]:
    from scgrpo.rollout.engine import eos_token_ids

    return eos_token_ids(policy.model, policy.tokenizer)
