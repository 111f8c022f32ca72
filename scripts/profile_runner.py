"""The episode runner's own host time, on CPU: ``EpisodeRunner.run`` over a stand-in policy whose sampler returns
precomputed turns at once, so that what is timed is the runner's bookkeeping, tokenizing and environment calls.

    python scripts/profile_runner.py                     # the multi-turn bench's shape, timed
    python scripts/profile_runner.py --chat --profile    # a chat-template tokenizer; cProfile's top entries
    python scripts/profile_runner.py --calls 20000       # call_all's cost per instant call too

The shape is ``scripts/bench_rollout.py``'s ``smollm2_64_multiturn`` case: 8 rows x 8 episodes, 4 turns of 32
model tokens, 24-word observations from ``RandomAnswers`` (answers at once), its word-level tokenizer (no chat
template). ``--chat`` takes the tests' byte-level tokenizer with a chat template instead (``tests/conftest.py``;
its tokens are bytes, so an observation is more tokens). The token budget leaves room for every turn and
observation (``--budget`` sets a smaller one: turns cut at it). The stand-in's turns are drawn once from a seeded
generator (ids that never end a turn, or, with ``--eos``, some turns that end at an end-of-sequence token), the
same at each run: ``--digest`` prints a hash of the episodes, identical before and after a change of the runner
that keeps its behaviour. Reports the median ms per ``run`` (``--repeats``), the runner's ``episode/env_time_s``,
and, with ``--calls``, ``call_all``'s microseconds per instant call (batches of 64, as a turn's).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import io
import os
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
from bench_rollout import CASES, EOS, RandomAnswers, word_tokenizer  # noqa: E402

from scgrpo.envs import EpisodeSettings  # noqa: E402
from scgrpo.envs.runner import CallPool, ChatTurns, EpisodeRunner  # noqa: E402
from scgrpo.rollout.engine import Generated  # noqa: E402


class InstantPolicy:
    """What the runner reads of a :class:`~scgrpo.policy.Policy`, with a sampler that returns precomputed turns:
    ``turns[k]`` answers the k-th call of a run (the call's row count taken from its front)."""

    sharded = False

    def __init__(self, tokenizer, max_new: int, turns: int, rows: int, vocab: tuple[int, int], eos: int,
                 eos_share: float = 0.0, seed: int = 0) -> None:
        self.tokenizer, self.device = tokenizer, torch.device("cpu")
        self.generation = SimpleNamespace(max_new_tokens=max_new)
        self.model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))
        gen = torch.Generator().manual_seed(seed)
        self.turns = []
        for _ in range(turns):
            ids = torch.randint(vocab[0], vocab[1], (rows, max_new), generator=gen)
            mask = torch.ones(rows, max_new)
            truncated = torch.ones(rows, dtype=torch.bool)
            if eos_share:  # some turns end early at end-of-sequence (right-padded after it, as the engine does)
                for i in torch.nonzero(torch.rand(rows, generator=gen) < eos_share).squeeze(1).tolist():
                    end = int(torch.randint(1, max_new, (1,), generator=gen))
                    ids[i, end - 1] = eos
                    ids[i, end:] = eos
                    mask[i, end:] = 0
                    truncated[i] = False
            logprobs = -torch.rand(rows, max_new, generator=gen) * mask
            self.turns.append(Generated(prompt_ids=torch.empty(0), prompt_mask=torch.empty(0), completion_ids=ids,
                                        completion_mask=mask, truncated=truncated, completions=[],
                                        entropy_sum=torch.rand(rows, generator=gen) * 10, sampler_logprobs=logprobs,
                                        stats={"rollout/decode_steps": float(max_new)}))
        self.calls = 0

    def format_prompts(self, questions: list[str]) -> list[str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return list(questions)
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                   add_generation_prompt=True) for q in questions]

    @contextlib.contextmanager
    def eval_mode(self):
        yield

    def one_model_state(self):
        return contextlib.nullcontext()

    def sample_ids(self, prompt_ids, prompt_mask, greedy=False, temperature=None, reserve=None) -> Generated:
        turn = self.turns[self.calls % len(self.turns)]
        self.calls += 1
        n = prompt_ids.shape[0]
        return Generated(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=turn.completion_ids[:n],
                         completion_mask=turn.completion_mask[:n], truncated=turn.truncated[:n], completions=[],
                         entropy_sum=turn.entropy_sum[:n], sampler_logprobs=turn.sampler_logprobs[:n],
                         stats=dict(turn.stats))


def setup(chat: bool, eos_share: float, budget: int = 0):
    """The runner, the stand-in policy, the rows and the episodes per row of the bench's multi-turn case."""
    spec = CASES["smollm2_64_multiturn"]
    n, new, turns, obs, group = spec["seqs"], spec["max_new"], spec["turns"], spec["observation"], spec["group"]
    if chat:
        from tests.conftest import build_tokenizer

        tok = build_tokenizer()
        vocab, eos = (3, len(tok)), tok.eos_token_id
    else:
        tok = word_tokenizer(1024)
        vocab, eos = (3, 1000), EOS
    policy = InstantPolicy(tok, new, turns, n, vocab, eos, eos_share)
    env = RandomAnswers(48, obs)
    # the bench's budget: every turn runs and the environment answers the last one too (an observation is as many
    # tokens as the tokenizer and template make of it)
    longest = max(len(ChatTurns(tok, env.observation_role).ids(answer, None)) for answer in env.answers)
    runner = EpisodeRunner(env, EpisodeSettings(max_turns=turns, max_episode_tokens=budget or turns * (new + longest)))
    rows = [{"id": f"row{i}", "question": "", "answer": 0} for i in range(n // group)]
    return runner, policy, rows, group


def run_once(runner, policy, rows, group):
    policy.calls = 0
    return runner.run(policy, rows, group, seed=0)


def digest(out) -> str:
    """A hash of everything an episode batch holds (tensors' values, texts, infos, statistics but the timings)."""
    h = hashlib.sha256()
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "env_mask", "truncated",
                 "rewards", "entropy_sum", "sampler_logprobs"):
        value = getattr(out, name)
        h.update(name.encode())
        if value is not None:
            h.update(str(value.dtype).encode() + str(tuple(value.shape)).encode())
            h.update(value.contiguous().numpy().tobytes())
    h.update(repr((out.questions, out.completions, out.infos)).encode())
    h.update(repr(sorted((k, v) for k, v in out.stats.items() if k != "episode/env_time_s")).encode())
    return h.hexdigest()[:16]


def time_call_all(calls: int, max_workers: int) -> float:
    """Microseconds per instant call of ``call_all``, in batches of 64 calls (a turn's) on ``max_workers`` threads."""
    batch = [int] * 64
    pool = CallPool()
    pool.call_all(batch, 10.0, max_workers)  # the threads started
    start = time.perf_counter()
    for _ in range(calls // len(batch)):
        pool.call_all(batch, 10.0, max_workers)
    return 1e6 * (time.perf_counter() - start) / (calls // len(batch) * len(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chat", action="store_true", help="the tests' byte-level tokenizer with a chat template")
    parser.add_argument("--eos", type=float, default=0.0, help="share of turns that end at end-of-sequence early")
    parser.add_argument("--budget", type=int, default=0,
                        help="the episodes' token budget (default: room for every turn and observation)")
    parser.add_argument("--profile", action="store_true", help="cProfile over the timed runs; prints the top")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--digest", action="store_true", help="print a hash of the episodes")
    parser.add_argument("--calls", type=int, default=0, help="time call_all over this many instant calls too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner, policy, rows, group = setup(args.chat, args.eos, args.budget)
    out = run_once(runner, policy, rows, group)  # warm-up: threads, the chat template's rendering
    if args.digest:
        print("digest", digest(out))
    times, env = [], []
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.repeats):
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        out = run_once(runner, policy, rows, group)
        times.append(time.perf_counter() - start)
        if profiler:
            profiler.disable()
        env.append(out.stats["episode/env_time_s"])
    print(f"run: median {1e3 * statistics.median(times):.1f} ms (min {1e3 * min(times):.1f}) over {args.repeats}; "
          f"environment calls {1e3 * statistics.median(env):.1f} ms; "
          f"{len(out.completions)} episodes, {out.completion_ids.shape[1]} tokens each at most")
    if args.calls:
        print(f"call_all: {time_call_all(args.calls, runner.settings.max_workers):.1f} us per instant call")
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue())
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
        print(text.getvalue())


if __name__ == "__main__":
    main()
