"""scripts/bench_rollout.py's multi-turn case in small, on CPU: the stand-in tokenizer and environment give
observations of exactly the asked length, the episodes are as long as asked, the prefills are counted (each turn
re-fills the whole histories), and scripts/bench_table.py turns the result into its two summary keys."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_rollout")
table = _load("bench_table")


def test_an_observation_of_n_words_is_n_tokens_after_a_turn():
    from scgrpo.envs.runner import ChatTurns

    tok = bench.word_tokenizer(1024)
    env = bench.RandomAnswers(prompt=8, words=5)
    prompt = env.reset({"id": "r"}, seed=3)
    observation = env.step(None).observation
    chat = ChatTurns(tok)
    ids = chat.ids(observation, ended_turn=None)
    assert ids == [int(word[1:]) for word in observation.split()] and len(ids) == 5
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == 8
    # words holding the special tokens' ids as digits ("t268") stay one token each
    assert tok("t268 t1002 t20", add_special_tokens=False)["input_ids"] == [268, 1002, 20]
    assert tok.pad_token_id == tok.eos_token_id == bench.EOS
    assert all(3 <= i < 1000 for text in env.prompts + env.answers for i in tok(text)["input_ids"])


@pytest.fixture(scope="module")
def smoke():
    torch.manual_seed(0)
    return bench.run_multiturn_case("multiturn_smoke", bench.SMOKE, 1, ["compact", "hf_static"], "cpu",
                                    torch.float32)


def test_the_smoke_case_plays_episodes_of_the_asked_lengths_and_counts_the_prefills(smoke):
    spec, lengths = bench.SMOKE, bench.episode_lengths(bench.SMOKE)
    assert smoke["episode_check"]["model_tokens"] == [spec["turns"] * spec["max_new"]]
    assert smoke["episode_check"]["environment_tokens"] == [(spec["turns"] - 1) * spec["observation"]]
    assert smoke["episode_check"]["prompt_tokens"] == [spec["prompt"]]
    # every turn prefills each whole history: the cache is re-filled, not kept
    whole = spec["seqs"] * sum(lengths["histories"])
    assert smoke["prefill_tokens"]["whole_histories"] == whole
    assert smoke["engines"]["compact_episodes"]["prefill_tokens"] == whole
    assert [tokens for tokens, _ in smoke["engines"]["compact_turns"]["prefill_calls"]] == [
        spec["seqs"] * h for h in lengths["histories"]]
    assert smoke["kv_cache_between_turns"] == "re-filled"
    assert smoke["engines"]["compact_single_turn"]["prefill_tokens"] == spec["seqs"] * spec["prompt"]
    assert set(smoke["engines"]) == {"compact_episodes", "compact_turns", "compact_single_turn", "hf_static_turns"}
    e = smoke["engines"]
    assert smoke["multiturn_over_hf_static"] == pytest.approx(e["hf_static_turns"]["median_s"]
                                                              / e["compact_episodes"]["median_s"])
    assert smoke["multiturn_over_singleturn_tok_s"] == pytest.approx(e["compact_single_turn"]["tok_s"]
                                                                     / e["compact_episodes"]["tok_s"])
    for name in ("compact_episodes", "compact_turns", "compact_single_turn"):
        keys = ("prefill_share", "decode_share", "environment_share", "other_share")
        parts = [e[name][k] for k in keys if k in e[name]]
        assert sum(parts) == pytest.approx(1.0) and e[name]["prefill_share"] > 0 and e[name]["decode_share"] > 0
    assert "environment_share" in e["compact_episodes"]


def test_bench_table_turns_the_result_into_the_summary_keys(smoke, tmp_path, monkeypatch):
    report = {"card": "CPU", "command": "python scripts/bench_rollout.py --smoke", "versions": {},
              "cases": {table.MULTITURN_CASE: smoke}}
    (tmp_path / "bench_rollout_multiturn_cpu.json").write_text(json.dumps(report))
    monkeypatch.setattr(table, "RESULTS", str(tmp_path))
    entries = table.multiturn_entries("cpu")
    assert set(entries) == {"multiturn_over_hf_static", "multiturn_over_singleturn_tok_s"}
    hf, single = entries["multiturn_over_hf_static"], entries["multiturn_over_singleturn_tok_s"]
    assert hf["value"] == round(smoke["multiturn_over_hf_static"], 3) and hf["target"] == ">= 3.0"
    assert hf["met"] == (smoke["multiturn_over_hf_static"] >= 3.0)
    assert single["target"] == "<= 1.5" and single["met"] == (smoke["multiturn_over_singleturn_tok_s"] <= 1.5)
    assert hf["card"] == "CPU" and hf["command"] == report["command"] and "re-filled" in hf["note"]
    rows = table.multiturn_table("cpu")
    assert sum(line.startswith(("| compact_", "| hf_")) for line in rows) == 4
    assert table.multiturn_entries("h100") == {} and table.multiturn_table("h100") == []


@pytest.mark.parametrize("chat", [False, True])
def test_the_runner_harness_plays_the_bench_episodes_the_same_each_run(chat):
    harness = _load("profile_runner")
    runner, policy, rows, group = harness.setup(chat, eos_share=0.0)
    out = harness.run_once(runner, policy, rows, group)
    spec = bench.CASES["smollm2_64_multiturn"]
    assert out.completion_mask.shape[0] == spec["seqs"] and policy.calls == spec["turns"]
    assert out.completion_mask.sum(1).tolist() == [spec["turns"] * spec["max_new"]] * spec["seqs"]
    if not chat:  # the word-level tokenizer: an observation of n words is n tokens
        assert out.env_mask.sum(1).tolist() == [(spec["turns"] - 1) * spec["observation"]] * spec["seqs"]
    assert out.stats["episode/turns_mean"] == spec["turns"] and out.stats["episode/truncated"] == 1.0
    assert harness.digest(harness.run_once(runner, policy, rows, group)) == harness.digest(out)
    early = harness.setup(chat, eos_share=0.5)  # some turns end at end-of-sequence: shorter episodes
    assert harness.run_once(*early).completion_mask.sum() < out.completion_mask.sum()


def test_bench_table_leaves_out_a_case_that_failed(tmp_path, monkeypatch, capsys):
    """A step case that ended in an error (bench_step.py keeps the steps it finished and the error) is no
    measurement: neither the rows nor a file's cases take it, and the table says so."""
    ok = {"case": "a", "wall_s": 1.0, "time_generation_s": 0.5}
    broken = {"case": "b", "wall_s": 2.0, "error": "GPUOutOfMemory: out of GPU memory in the rollout phase"}
    payload = {"card": "CPU", "command": "python scripts/bench_step.py", "versions": {}, "cases": [ok, broken]}
    (tmp_path / "bench_demo_cpu.json").write_text(json.dumps(payload))
    monkeypatch.setattr(table, "RESULTS", str(tmp_path))
    assert [row["case"] for row in table.load_rows("cpu")] == ["a"]
    assert list(table.file_cases("bench_demo_cpu.json")) == ["a"]
    assert "b left out, it failed: GPUOutOfMemory" in capsys.readouterr().err
