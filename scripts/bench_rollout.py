"""Rollout throughput: the compact engine, the Hugging Face-forward decode loop and ``model.generate`` (dynamic and
static cache), in one process on one card, on randomly initialised models with real shapes.

    python scripts/bench_rollout.py                       # SmolLM2-135M shape at 64 and 512 sequences, the
                                                          # Qwen2.5-1.5B shape at 32 x 512, LoRA merged/unmerged
    python scripts/bench_rollout.py --cases smollm2_64    # one case
    python scripts/bench_rollout.py --cases smollm2_64_multiturn --repeats 5
                                                          # multi-turn episodes (below), on their own
    python scripts/bench_rollout.py --smoke               # the multi-turn case in small (CPU without a GPU)

Every case: bf16, prompts of 48 random tokens (no padding), ``max_new`` new tokens forced (end-of-sequence
banned until then), sampling at T=1. Each engine runs once untimed (CUDA graphs, ``torch.compile`` and
transformers' static-cache compilation happen there), then ``--repeats`` timed calls bracketed by
``torch.cuda.synchronize``; the median is reported as new tokens per second and ms per new token. LoRA cases
compare the compact engine with r=16 adapters on every linear layer kept unmerged against the same weights
merged (timed in turn, round by round, with each rollout's weight refresh and prefill timed apart too), each with its default decode step (adapters: the Triton block kernels of ``scgrpo.rollout.norms``; none:
the ``torch.compile``'d step), and with engine ``other_step`` each with the other step too; with engine
``lora_after_matmul`` the unmerged model's block kernels with every LoRA term added after its matmul (by the kernels
that read it), at every row count; with engine ``public`` the public ``generate_ids`` on the peft model as a user
passes it and on the merged one, each with its default sampler (kept on the model) and with one passed in. Also measured: greedy agreement with ``generate`` in bf16 (share of tokens equal, row by row, up to
the first difference) and the sampler's log-probabilities against a full forward pass of the sampled tokens.
Writes ``benchmarks/results/bench_rollout_<card>.json``; ``scripts/bench_table.py`` makes the tables.

The multi-turn case (``smollm2_64_multiturn``): 64 episodes (8 rows x 8) of 4 model turns of 32 forced tokens
each, 48-token prompts, after each turn a 24-token observation from an environment that answers at once,
sampling at T=1, all in one call on one card; its results go to
``benchmarks/results/bench_rollout_multiturn_<card>.json`` (summary keys ``multiturn_over_hf_static`` and
``multiturn_over_singleturn_tok_s``). Engines:

- ``compact_episodes``: :class:`~scgrpo.envs.runner.EpisodeRunner` over a :class:`~scgrpo.policy.Policy`, the
  path of training: each turn ``Policy.sample_ids`` -> ``generate_ids`` -> the compact engine with the runner's
  ``reserve``, the environments called in threads, observations tokenized and appended as ids. A random model
  has no tokenizer: a word-level one stands in (word ``t<i>`` is token ``i``); without a chat template the
  runner puts each observation between blank lines, which that tokenizer drops: 24 words are 24 tokens;
- ``compact_turns``: ``generate_ids`` called turn by turn on the histories as device tensors (observations
  drawn there), with the same ``reserve``: the engine without the runner's host work;
- ``compact_single_turn``: ``generate_ids`` once, 64 rows x 128 (= 4 x 32) new tokens: the single-turn
  reference;
- ``hf_static_turns``: ``model.generate(cache_implementation="static")`` turn by turn on histories of the same
  lengths (its own samples, random observations); generate allocates a static cache each call, as long as the
  longest so far (one shape for its compiled step once the untimed episode has run).

Model tokens per second count the sampled tokens alone (64 x 128 for each engine). The compact engines' prefills
and decode bursts are timed apart (each bracketed by synchronisation, which the engine does around them anyway)
and the prompt tokens prefilled are counted: turns that prefill each whole history mean the KV cache is
re-filled between turns, not kept (``kv_cache_between_turns``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_step import QWEN_1P5B, card_name, card_tag, versions  # noqa: E402

from scgrpo.envs import Environment, StepResult  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
CASES = {
    "smollm2_64": dict(shape="smollm2", family="llama", seqs=64, max_new=128),
    "smollm2_512": dict(shape="smollm2", family="llama", seqs=512, max_new=128),
    "qwen1p5b_32": dict(shape="qwen1p5b", family="qwen2", seqs=32, max_new=512),
    "smollm2_64_lora": dict(shape="smollm2", family="llama", seqs=64, max_new=128, lora=True),
    "smollm2_512_lora": dict(shape="smollm2", family="llama", seqs=512, max_new=128, lora=True),
    # max_new: tokens a model turn; turns; observation: tokens an environment answer; group: episodes a row
    "smollm2_64_multiturn": dict(shape="smollm2", family="llama", seqs=64, max_new=32, turns=4,
                                 observation=24, group=8),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1024, max_position_embeddings=1024, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOKE = dict(shape="tiny", family="llama", seqs=4, max_new=4, turns=3, observation=5, group=2, prompt=8)
"""The multi-turn case in small (``--smoke``): a check that it runs, on CPU too"""
PROMPT = 48
EOS = 2


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(shape: str, family: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dims = {"smollm2": SMOLLM2_135M, "qwen1p5b": QWEN_1P5B, "tiny": TINY}[shape]
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**dims, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # trained adapters (B starts at zero): a visible, small update
            torch.nn.init.normal_(param, std=0.02)
    return peft_model.to(torch.bfloat16).eval()


def timed(fn, repeats: int) -> dict:
    return timed_together({"run": fn}, repeats)["run"]


def timed_together(fns: dict, repeats: int) -> dict:
    """Each of ``fns`` run once untimed (graphs, compilation), then ``repeats`` rounds that time each once, in an
    order that rotates from round to round (a drift of the card's clocks or the host's load spreads over every
    engine). A function's ``phases`` attribute, when it has one, collects its own sub-timings (seconds) per call."""
    for fn in fns.values():
        fn()  # warm-up
        getattr(fn, "phases", {}).clear()
    times: dict = {name: [] for name in fns}
    order = list(fns)
    for round_ in range(repeats):
        for name in order[round_ % len(order):] + order[: round_ % len(order)]:  # each round starts elsewhere
            fn = fns[name]
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    stats = {}
    for name, fn in fns.items():
        stats[name] = {"median_s": statistics.median(times[name]), "times_s": times[name]}
        for phase, values in getattr(fn, "phases", {}).items():
            stats[name][f"{phase}_median_s"] = statistics.median(values)
    return stats


def compact_runner(model, ids, mask, max_new: int, greedy: bool = False, **kwargs):
    from scgrpo.rollout.compact import CompactDecoder
    from scgrpo.rollout.slots import SlotDecoder

    decoder = CompactDecoder(model, compile_layers=kwargs.pop("compile_layers", True),
                             block_kernels=kwargs.pop("block_kernels", None),
                             lora_matmul_rows=kwargs.pop("lora_matmul_rows", None))
    sampler = SlotDecoder(decoder, [EOS], EOS, max_new, greedy=greedy, min_new_tokens=0 if greedy else max_new,
                          **kwargs)

    admit = sampler._admit

    spent = [0.0]

    def timed_prefill(*args):  # (synchronised: the prompts' forward passes timed apart from the decode steps; the
        torch.cuda.synchronize()  # admission, around any recording of the prefill as a CUDA graph)
        start = time.perf_counter()
        admit(*args)
        torch.cuda.synchronize()
        spent[0] += time.perf_counter() - start

    sampler._admit = timed_prefill

    def run():
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.refresh()  # the adapters' (or merged weights') copies for this rollout
        torch.cuda.synchronize()
        run.phases.setdefault("refresh", []).append(time.perf_counter() - start)
        spent[0] = 0.0
        result = sampler(ids, mask)
        run.phases.setdefault("prefill", []).append(spent[0])  # every prefill of the rollout (chunks of prompts)
        return result

    run.phases = {}
    return run, sampler


def public_runner(model, ids, mask, max_new: int, kept: bool):
    """The package's public ``scgrpo.rollout.generate_ids`` on ``model`` as the user has it (a peft model passed as
    it is): with ``sampler=None``, its default, the sampler it keeps on the model between calls, or, with ``kept``,
    one made here and passed in at every call."""
    from scgrpo.rollout import GenerationSettings
    from scgrpo.rollout.backends import make_sampler
    from scgrpo.rollout.engine import generate_ids

    settings = GenerationSettings(max_new_tokens=max_new, min_new_tokens=max_new)
    tokenizer = SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS)
    sampler = make_sampler(settings) if kept else None

    def run():
        out = generate_ids(model, tokenizer, ids, mask, settings, texts=False, sampler=sampler)
        run.stats = dict(out.stats)
        return out.completion_ids

    run.stats = {}
    return run


def hf_runner(model, ids, mask, max_new: int, static: bool, greedy: bool = False):
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=None if greedy else max_new, pad_token_id=EOS,
                  eos_token_id=EOS, do_sample=not greedy)
    if not greedy:
        kwargs.update(temperature=1.0, top_p=1.0, top_k=None)
    if static:
        kwargs["cache_implementation"] = "static"

    def run():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]

    return run


def loop_runner(model, ids, mask, max_new: int):
    from scgrpo.rollout.engine import decode_loop

    def run():
        with torch.no_grad():
            return decode_loop(model, ids, mask, max_new, [EOS], EOS, min_new_tokens=max_new, cuda_graphs=True)

    return run


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens equal up to each row's first difference (greedy decodes diverge for good after one)."""
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).long().cumprod(1)
    return float(same.sum()) / same.numel()


def sampler_vs_forward(model, ids, tokens, logprobs) -> dict:
    """|log p_sampler - log p_forward| on the sampled tokens, the forward being the model's own (HF) pass."""
    with torch.no_grad():
        full = torch.cat([ids, tokens], 1)
        logits = model(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(2, tokens.unsqueeze(2)).squeeze(2)
    diff = (logprobs - reference).abs()
    return {"logprob_mismatch_mean": float(diff.mean()), "logprob_mismatch_max": float(diff.max())}


def run_case(name: str, spec: dict, repeats: int, engines: list[str]) -> dict:
    model = build_model(spec["shape"], spec["family"])
    n, max_new = spec["seqs"], spec["max_new"]
    torch.manual_seed(2)
    ids = torch.randint(3, 1000, (n, 48), device="cuda")
    mask = torch.ones_like(ids)
    new_tokens = n * max_new
    result: dict = {"case": name, **spec, "prompt_tokens": 48, "engines": {}}

    def record(engine: str, stats: dict, extra: dict | None = None) -> None:
        stats.update(tok_s=new_tokens / stats["median_s"], ms_per_step=1000 * stats["median_s"] / max_new, **(extra or {}))
        result["engines"][engine] = stats
        print(f"{name:>18} {engine:>16}: {stats['tok_s']:>10,.0f} new tok/s  {stats['ms_per_step']:.2f} ms/step", flush=True)

    if spec.get("lora"):  # each model's default step; with "other_step", the other step too (same call)
        peft_model = add_lora(model)
        merged = copy.deepcopy(peft_model).merge_and_unload()
        runners = {"compact_unmerged": compact_runner(peft_model, ids, mask, max_new)}  # default: block kernels
        if "lora_after_matmul" in engines:  # the block kernels with every LoRA term added after its matmul
            runners["compact_unmerged_lora_after_matmul"] = compact_runner(peft_model, ids, mask, max_new,
                                                                           lora_matmul_rows=0)
        other = "other_step" in engines
        if other:
            runners["compact_unmerged_compiled_step"] = compact_runner(peft_model, ids, mask, max_new,
                                                                       block_kernels=False)
        runners["compact_merged"] = compact_runner(merged, ids, mask, max_new)  # default: the compiled step
        if other:
            runners["compact_merged_block_step"] = compact_runner(merged, ids, mask, max_new, block_kernels=True)
        public = {}
        if "public" in engines:  # the public generate_ids on the peft model and on the merged one, same rounds
            for kept in (False, True):
                suffix = "_kept" if kept else ""
                public[f"public_unmerged{suffix}"] = public_runner(peft_model, ids, mask, max_new, kept)
                public[f"public_merged{suffix}"] = public_runner(merged, ids, mask, max_new, kept)
        stats = timed_together({**{name: run for name, (run, _) in runners.items()}, **public}, repeats)
        for engine, (_, sampler) in runners.items():
            record(engine, stats[engine], dict(sampler.stats))
        for engine, run in public.items():
            record(engine, stats[engine], dict(run.stats))
        tokens, logprobs, _ = runners["compact_unmerged"][0]()  # on-policy: against the adapted model's forward
        result["unmerged_sampler_vs_forward_bf16"] = sampler_vs_forward(peft_model, ids, tokens, logprobs)
        e = result["engines"]
        result["unmerged_over_merged"] = e["compact_unmerged"]["median_s"] / e["compact_merged"]["median_s"]
        if "compact_unmerged_lora_after_matmul" in e:
            result["unmerged_lora_after_matmul_over_merged"] = (e["compact_unmerged_lora_after_matmul"]["median_s"]
                                                                / e["compact_merged"]["median_s"])
        for suffix in ("", "_kept") if public else ():
            result[f"public{suffix}_unmerged_over_merged"] = (e[f"public_unmerged{suffix}"]["median_s"]
                                                              / e[f"public_merged{suffix}"]["median_s"])
        if other:  # the same step both ways
            result["unmerged_over_merged_block_step"] = (e["compact_unmerged"]["median_s"]
                                                         / e["compact_merged_block_step"]["median_s"])
            result["unmerged_over_merged_compiled_step"] = (e["compact_unmerged_compiled_step"]["median_s"]
                                                            / e["compact_merged"]["median_s"])
        return result
    if "compact" in engines:
        run, sampler = compact_runner(model, ids, mask, max_new)
        record("compact", timed(run, repeats), dict(sampler.stats))
        tokens, logprobs, _ = run()
        result["sampler_vs_forward_bf16"] = sampler_vs_forward(model, ids, tokens, logprobs)
    if "other_step" in engines:  # the other step: Triton block kernels, not torch.compile'd code
        run, sampler = compact_runner(model, ids, mask, max_new, block_kernels=True)
        record("compact_block_step", timed(run, repeats), dict(sampler.stats))
    if "compact_eager" in engines:
        run, sampler = compact_runner(model, ids, mask, max_new, compile_layers=False)
        record("compact_eager", timed(run, repeats), dict(sampler.stats))
    if "loop_hf_forward" in engines:
        record("loop_hf_forward", timed(loop_runner(model, ids, mask, max_new), repeats))
    if "hf_static" in engines:
        record("hf_static", timed(hf_runner(model, ids, mask, max_new, static=True), repeats))
    if "hf_dynamic" in engines:
        record("hf_dynamic", timed(hf_runner(model, ids, mask, max_new, static=False), max(1, repeats // 2)))
    if "compact" in engines and "hf_static" in engines:
        result["compact_over_hf_static"] = result["engines"]["compact"]["tok_s"] / result["engines"]["hf_static"]["tok_s"]
        greedy_ref = hf_runner(model, ids[:64], mask[:64], 64, static=False, greedy=True)()
        run, _ = compact_runner(model, ids[:64], mask[:64], 64, greedy=True)
        result["greedy_agreement_bf16"] = agreement(run()[0], greedy_ref)
    del model
    torch.cuda.empty_cache()
    return result


# -------------------------------------------------------------------------------------- multi-turn episodes
class RandomAnswers(Environment):
    """Answers every model turn at once with one of a few fixed texts of ``words`` random words ``t<i>``
    (ids 3-999: never end-of-sequence); its first observation, the prompt, has ``prompt`` of them. Episodes end
    at the turn limit."""

    timeout_s = 60.0

    def __init__(self, prompt: int, words: int, texts: int = 16) -> None:
        rng = random.Random(0)

        def text(n: int) -> str:
            return " ".join(f"t{rng.randrange(3, 1000)}" for _ in range(n))

        self.prompts = [text(prompt) for _ in range(texts)]
        self.answers = [text(words) for _ in range(texts)]

    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        return self.prompts[seed % len(self.prompts)]

    def step(self, action):
        self.turn += 1
        return StepResult(observation=self.answers[(self.seed + self.turn) % len(self.answers)])


def word_tokenizer(vocab_size: int):
    """A fast tokenizer whose words ``t3`` ... ``t<vocab_size - 1>`` are those token ids, split at white space
    (0-2: ``<unk>``, ``<s>``, ``</s>``, the end-of-sequence and pad token); no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    assert special.index("</s>") == EOS
    vocab = {word: i for i, word in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


@dataclasses.dataclass
class EngineClock:
    """Seconds in the compact engine's prefills and decode bursts, and the prompt tokens prefilled, of a run."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: list = dataclasses.field(default_factory=list)  # (tokens, seconds) of each prefill

    def reset(self) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = 0
        self.prefill_calls = []


@contextlib.contextmanager
def engine_clock():
    """Every :class:`SlotDecoder` admission (the prefill of the rows it admits, recorded or replayed as a CUDA
    graph or not, and the draw of their first tokens) and decode burst timed, bracketed by synchronisation (the
    engine reads the device right after each anyway), into the yielded clock."""
    from scgrpo.rollout.slots import SlotDecoder

    clock = EngineClock()
    admit, run = SlotDecoder._admit, SlotDecoder._run

    def timed_prefill(self, state, out, right, lengths, rows, slots):
        sync()
        start = time.perf_counter()
        admit(self, state, out, right, lengths, rows, slots)
        sync()
        seconds = time.perf_counter() - start
        tokens = int(lengths[rows].sum())
        clock.prefill_s += seconds
        clock.prefill_tokens += tokens
        clock.prefill_calls.append((tokens, seconds))

    def timed_run(self, *args):
        sync()
        start = time.perf_counter()
        run(self, *args)
        sync()
        clock.decode_s += time.perf_counter() - start

    SlotDecoder._admit, SlotDecoder._run = timed_prefill, timed_run
    try:
        yield clock
    finally:
        SlotDecoder._admit, SlotDecoder._run = admit, run


def clocked(fn, clock: EngineClock, phases=None):
    """``fn`` with the engine's prefill and decode seconds of each call as its ``phases`` (and those that
    ``phases(result)`` names), the prompt tokens it prefilled and the sizes and seconds of its prefills, its
    last result kept."""

    def run():
        clock.reset()
        run.last = fn()
        run.phases.setdefault("prefill", []).append(clock.prefill_s)
        run.phases.setdefault("decode", []).append(clock.decode_s)
        for name, seconds in (phases(run.last) if phases else {}).items():
            run.phases.setdefault(name, []).append(seconds)
        run.prefill_tokens.append(clock.prefill_tokens)
        run.prefill_calls.append(list(clock.prefill_calls))
        return run.last

    run.phases, run.prefill_tokens, run.prefill_calls, run.last = {}, [], [], None
    return run


def episode_lengths(spec: dict) -> dict:
    """Token counts of one episode of the multi-turn ``spec``: its prompt, each turn's history (what a turn
    prefills when the cache is re-filled), and its model and environment tokens."""
    prompt, new, turns, obs = spec.get("prompt", PROMPT), spec["max_new"], spec["turns"], spec["observation"]
    return {"prompt": prompt, "histories": [prompt + t * (new + obs) for t in range(turns)],
            "model": turns * new, "environment": (turns - 1) * obs}


def run_multiturn_case(name: str, spec: dict, repeats: int, engines: list[str], device: str,
                       dtype: torch.dtype) -> dict:
    from scgrpo.distributed import PolicyRunner
    from scgrpo.envs import EpisodeSettings
    from scgrpo.envs.runner import EpisodeRunner
    from scgrpo.policy import Policy
    from scgrpo.rollout.engine import GenerationSettings, generate_ids

    model = build_model(spec["shape"], spec["family"], device, dtype)
    n, new, turns, obs = spec["seqs"], spec["max_new"], spec["turns"], spec["observation"]
    group = spec["group"]
    lengths = episode_lengths(spec)
    prompt = lengths["prompt"]
    tokenizer = word_tokenizer(model.config.vocab_size)
    settings = GenerationSettings(num_generations=group, max_new_tokens=new, min_new_tokens=new)
    single = dataclasses.replace(settings, max_new_tokens=turns * new, min_new_tokens=turns * new)
    policy = Policy(PolicyRunner(model), tokenizer, settings, torch.device(device))
    # the token budget of the whole episode (its turns and every observation, the last one included): each
    # turn runs and the environment answers the last one too
    episode_settings = EpisodeSettings(max_turns=turns, max_episode_tokens=turns * (new + obs))
    runner = EpisodeRunner(RandomAnswers(prompt, obs), episode_settings)
    rows = [{"id": f"row{i}", "question": "", "answer": 0} for i in range(n // group)]
    reserve = (n, prompt + episode_settings.max_episode_tokens + new)  # as the runner sizes it
    torch.manual_seed(2)
    ids = torch.randint(3, 1000, (n, prompt), device=device)
    mask = torch.ones_like(ids)
    # CUDA graphs recorded by each call (the untimed one first): turn by turn, or the runner's sum of its turns
    graphs: dict[str, list] = {}
    widths: set[int] = set()  # the final histories' lengths (every row has them all)

    def episodes():
        out = runner.run(policy, rows, group, seed=0)
        graphs.setdefault("compact_episodes", []).append([out.stats.get("rollout/graphs_recorded", 0.0)])
        return out

    def turn_by_turn():
        history, recorded = ids, []
        for turn in range(turns):
            out = generate_ids(model, tokenizer, history, torch.ones_like(history), settings, reserve=reserve,
                               sampler=policy.sampler)  # (the runner's backend: one workspace for all)
            recorded.append(out.stats.get("rollout/graphs_recorded", 0.0))
            history = torch.cat([history, out.completion_ids], 1)
            if turn + 1 < turns:
                history = torch.cat([history, torch.randint(3, 1000, (n, obs), device=device)], 1)
        graphs.setdefault("compact_turns", []).append(recorded)
        widths.add(history.shape[1])
        return history

    def single_turn():
        out = generate_ids(model, tokenizer, ids, mask, single, sampler=policy.sampler)
        graphs.setdefault("compact_single_turn", []).append([out.stats.get("rollout/graphs_recorded", 0.0)])
        return out

    hf_kwargs = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=EOS, eos_token_id=EOS,
                     do_sample=True, temperature=1.0, top_p=1.0, top_k=None, cache_implementation="static")

    def hf_static_turns():
        history = ids
        with torch.no_grad():
            for turn in range(turns):
                history = model.generate(input_ids=history, attention_mask=torch.ones_like(history),
                                         **hf_kwargs)
                if turn + 1 < turns:
                    history = torch.cat([history, torch.randint(3, 1000, (n, obs), device=device)], 1)
        widths.add(history.shape[1])
        return history

    result: dict = {"case": name, **spec, "prompt_tokens": prompt, "episodes": n,
                    "model_tokens": n * lengths["model"],
                    "max_episode_tokens": episode_settings.max_episode_tokens, "reserve": list(reserve),
                    "engines": {}}

    def environment(out) -> dict:  # the runner's calls of spawn, reset and step (the answers are instant)
        return {"environment": out.stats["episode/env_time_s"]}

    with engine_clock() as clock:
        fns = {}
        if "compact" in engines:
            fns.update(compact_episodes=clocked(episodes, clock, environment),
                       compact_turns=clocked(turn_by_turn, clock),
                       compact_single_turn=clocked(single_turn, clock))
        if "hf_static" in engines:
            fns["hf_static_turns"] = hf_static_turns
        stats = timed_together(fns, repeats)
    for engine, fn in fns.items():
        s = stats[engine]
        s.update(tok_s=result["model_tokens"] / s["median_s"],
                 ms_per_step=1000 * s["median_s"] / lengths["model"])  # (per model token of a row)
        if "prefill_median_s" in s:
            s.update(prefill_share=s["prefill_median_s"] / s["median_s"],
                     decode_share=s["decode_median_s"] / s["median_s"],
                     prefill_tokens=statistics.median(fn.prefill_tokens),
                     # (tokens, median seconds) of each prefill of a call, in order
                     prefill_calls=[[calls[0][0], statistics.median(c[1] for c in calls)]
                                    for calls in zip(*fn.prefill_calls)],
                     graphs_recorded_untimed=graphs[engine][0], graphs_recorded_timed=graphs[engine][1:])
            if "environment_median_s" in s:
                s["environment_share"] = s["environment_median_s"] / s["median_s"]
            # the host's own work: the runner's bookkeeping and tokenizing, each call's set-up and outputs
            s["other_share"] = 1.0 - s["prefill_share"] - s["decode_share"] - s.get("environment_share", 0.0)
        result["engines"][engine] = s
        extra = (f"  prefill {100 * s['prefill_share']:.0f}%  decode {100 * s['decode_share']:.0f}%"
                 + (f"  environment {100 * s['environment_share']:.0f}%" if "environment_share" in s else "")
                 + f"  other {100 * s['other_share']:.0f}%" if "prefill_share" in s else "")
        print(f"{name:>20} {engine:>20}: {s['tok_s']:>10,.0f} model tok/s  {s['ms_per_step']:.2f} ms per "
              "model token" + extra, flush=True)

    e = result["engines"]
    if "compact" in engines:
        out = fns["compact_episodes"].last
        result["episode_check"] = {
            "model_tokens": sorted({int(v) for v in out.completion_mask.sum(1).tolist()}),
            "environment_tokens": sorted({int(v) for v in out.env_mask.sum(1).tolist()}),
            "prompt_tokens": sorted({int(v) for v in out.prompt_mask.sum(1).tolist()}),
            "turns_mean": out.stats["episode/turns_mean"], "truncated": out.stats["episode/truncated"]}
        if (result["episode_check"]["model_tokens"] != [lengths["model"]]
                or result["episode_check"]["environment_tokens"] != [lengths["environment"]]):
            raise RuntimeError(f"episodes of other lengths than asked: {result['episode_check']}")
        refilled = n * sum(lengths["histories"])  # every turn prefills each whole history
        measured = e["compact_episodes"]["prefill_tokens"]
        result["kv_cache_between_turns"] = "re-filled" if measured >= refilled else "kept"
        result["prefill_tokens"] = {"measured": measured, "whole_histories": refilled,
                                    "if_kept": n * (prompt + (turns - 1) * obs)}
        result["multiturn_over_singleturn_tok_s"] = (e["compact_single_turn"]["tok_s"]
                                                     / e["compact_episodes"]["tok_s"])
    width = prompt + lengths["model"] + lengths["environment"]
    if widths and widths != {width}:
        raise RuntimeError(f"histories of {sorted(widths)} tokens, not {width}")
    if "compact" in engines and "hf_static" in engines:
        result["multiturn_over_hf_static"] = (e["hf_static_turns"]["median_s"]
                                              / e["compact_episodes"]["median_s"])
        result["turns_over_hf_static"] = e["hf_static_turns"]["median_s"] / e["compact_turns"]["median_s"]
    policy.release_rollout_workspaces()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def default_out(name: str) -> str:
    """Where a case's results go: multi-turn cases apart from the single-turn ones."""
    stem = "bench_rollout_multiturn" if "turns" in CASES[name] else "bench_rollout"
    return os.path.join(ROOT, "benchmarks", "results", f"{stem}_{card_tag()}.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(name for name, spec in CASES.items()
                                                     if "turns" not in spec),
                        help="comma-separated; by default every single-turn case (" + ", ".join(CASES) + ")")
    parser.add_argument("--engines", default="compact,other_step,compact_eager,loop_hf_forward,hf_static,"
                        "hf_dynamic", help="multi-turn cases run compact (its three engines) and hf_static")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="one file for every case (default: benchmarks/results/"
                        "bench_rollout_<card>.json, multi-turn cases bench_rollout_multiturn_<card>.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="the multi-turn case on a tiny model with a few episodes, on CPU where no GPU is; "
                             "written to --out only")
    args = parser.parse_args()
    engines = args.engines.split(",")
    command = " ".join(["python scripts/bench_rollout.py"] + [a for a in sys.argv[1:]
                                                              if a not in (args.out, "--out")
                                                              and not a.startswith("--out=")])
    if args.smoke:
        cuda = torch.cuda.is_available()
        result = run_multiturn_case("multiturn_smoke", SMOKE, args.repeats, engines, "cuda" if cuda else "cpu",
                                    torch.bfloat16 if cuda else torch.float32)
        print(json.dumps({k: v for k, v in result.items() if k != "engines"}, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"card": card_name(), "versions": versions(), "command": command,
                           "cases": {"multiturn_smoke": result}}, f, indent=1)
            print("wrote", args.out)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_rollout.py measures GPU throughput; no CUDA device found (--smoke runs on CPU)")
    reports: dict[str, dict] = {}
    for name in args.cases.split(","):
        out = args.out or default_out(name)
        report = reports.setdefault(out, {"card": card_name(), "versions": versions(), "command": command,
                                          "cases": {}})
        spec = CASES[name]
        report["cases"][name] = (run_multiturn_case(name, spec, args.repeats, engines, "cuda", torch.bfloat16)
                                 if "turns" in spec else run_case(name, spec, args.repeats, engines))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    for out in reports:
        print("wrote", out)

if __name__ == "__main__":
    main()
