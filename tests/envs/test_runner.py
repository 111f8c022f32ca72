"""The episode runner's machinery (``scgrpo/envs/runner.py``): the pool of threads that runs environment calls within
their time limits (:class:`CallPool`, its clock injected so that limits pass without sleeping them), and the rendering
of observations between model turns (:class:`ChatTurns`)."""

from __future__ import annotations

import threading
import time

import pytest

from scgrpo.envs.runner import CallPool, ChatTurns
from tests.envs.scripted import FastClock


def call_all(calls, timeout_s, max_workers, pool=None):
    return (pool or CallPool()).call_all(calls, timeout_s, max_workers)


def test_call_all_returns_values_errors_and_timeouts_in_order():
    def boom():
        raise KeyError("x")

    release = threading.Event()
    clock = FastClock(50.0)
    try:
        out = call_all([lambda: 1, boom, release.wait, lambda: 4], timeout_s=2.0, max_workers=2,
                       pool=CallPool(clock, clock.rate))
    finally:
        release.set()
    assert 2.0 <= clock() < 50.0  # the hung call's limit, by the pool's clock (40 ms real)
    assert out[0] == ("ok", 1) and out[1][0] == "error" and isinstance(out[1][1], KeyError)
    assert out[2] == ("timeout", None) and out[3] == ("ok", 4)


def test_a_hung_call_among_many_instant_ones_times_out_alone_and_the_results_keep_the_calls_order():
    release = threading.Event()
    calls = [lambda i=i: (time.sleep(0.002 * (i % 3)), i)[1] for i in range(40)]  # varied lengths: out of order
    calls[7] = release.wait
    clock = FastClock(50.0)
    try:
        out = call_all(calls, timeout_s=5.0, max_workers=4, pool=CallPool(clock, clock.rate))
    finally:
        release.set()
    assert 5.0 <= clock() < 100.0
    assert out[7] == ("timeout", None)
    assert out[:7] + out[8:] == [("ok", i) for i in range(40) if i != 7]


def test_each_call_has_its_time_limit_from_its_own_start():
    # one worker: the calls run one after the other, each well within the limit, together past it
    start = time.monotonic()
    out = call_all([lambda: time.sleep(0.15) or "a", lambda: time.sleep(0.15) or "b", lambda: time.sleep(0.15) or "c"],
                   timeout_s=0.3, max_workers=1)
    assert out == [("ok", "a"), ("ok", "b"), ("ok", "c")] and time.monotonic() - start >= 0.45


def test_calls_that_hang_in_every_worker_are_left_behind_and_the_others_still_run():
    release = threading.Event()
    try:
        out = call_all([release.wait, release.wait] + [lambda i=i: i for i in range(5)], timeout_s=2.0, max_workers=2,
                       pool=CallPool(FastClock(50.0), 50.0))
    finally:
        release.set()
    assert out == [("timeout", None)] * 2 + [("ok", i) for i in range(5)]


def test_call_all_runs_at_most_max_workers_calls_at_once_and_uses_them():
    lock, now, peak = threading.Lock(), [0], [0]

    def call():
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.1)
        with lock:
            now[0] -= 1

    out = call_all([call] * 9, timeout_s=5.0, max_workers=3)
    assert out == [("ok", None)] * 9 and peak[0] == 3  # three at once (a time bound would be the machine's load's)


def test_workers_take_no_more_calls_once_their_caller_has_left(monkeypatch):
    """A caller that leaves early (interrupted, or out of threads) stops the batch: its calls are not all run."""
    from scgrpo.envs import calls

    ran = []

    def call():
        time.sleep(0.05)
        ran.append(1)

    def interrupted(pool, batch, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(calls.CallPool, "_wait_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        call_all([call] * 20, timeout_s=5.0, max_workers=1)
    time.sleep(0.5)
    assert len(ran) <= 2  # the call under way when the caller left, at most one more


def test_call_all_counts_an_exception_of_any_kind_as_an_error():
    class Stop(BaseException):
        pass

    def stop():
        raise Stop()

    out = call_all([stop, lambda: 2], timeout_s=1.0, max_workers=1)
    assert out[0][0] == "error" and isinstance(out[0][1], Stop) and out[1] == ("ok", 2)


def test_observations_tokenized_together_are_each_tokenized_alone(tiny_model_dir):
    from transformers import AutoTokenizer

    chat = ChatTurns(AutoTokenizer.from_pretrained(tiny_model_dir))
    eos = chat.tokenizer.eos_token
    observations, ended = ["obs1", "obs 2", "obs1", "", "obs1"], [None, eos, None, eos, eos]
    together = chat.ids_many(observations, ended)
    assert together == [chat.ids(o, e) for o, e in zip(observations, ended)]
    for ids, observation, end in zip(together, observations, ended):  # each as its own text, tokenized alone
        head = chat.after_turn[len(end):] if end and chat.after_turn.startswith(end) else chat.after_turn
        assert ids == chat.tokenizer(head + observation + chat.after, add_special_tokens=False)["input_ids"]
    assert together[0] != together[4]  # the end-of-turn text the model sampled is not repeated
    together[0].append(-1)  # each a list of its own
    assert together[2] == chat.ids("obs1", None)
    assert chat.ids_many([], []) == []


def test_calls_that_keep_hanging_stop_the_run_with_a_clear_error(monkeypatch):
    from scgrpo.envs import calls

    pool = CallPool(FastClock(50.0), 50.0, max_stuck=3)
    release = threading.Event()
    try:
        with pytest.raises(calls.EnvironmentHangs, match="environment hangs"):
            for _ in range(3):  # 4 calls hang each time
                pool.call_all([release.wait] * 4 + [lambda: 1], timeout_s=2.5, max_workers=5)
    finally:
        release.set()  # the stuck calls return and are no longer counted
    for _ in range(200):
        if pool.stuck == 0:
            break
        time.sleep(0.02)
    assert pool.stuck == 0
