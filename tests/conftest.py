"""Shared fixtures: a tiny random Llama with a byte-level tokenizer, saved as a Hugging Face folder."""

from __future__ import annotations

import os

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 32-dim random Llama + byte-level tokenizer with a chat template (no download)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    model = build_tiny_llama(len(tokenizer))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCGRPO_CACHE", str(tmp_path / "cache"))


def pytest_configure(config):
    """Ctrl-C as Python sets it up in a terminal: a shell that starts the suite in the background (``cmd &``, no job
    control) hands it SIGINT ignored, where Python installs no handler and the interrupt tests would see none."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    """The Triton-interpreter run of the kernel tests takes its own process and most of a minute: started now,
    it runs beside the other tests (``tests/rollout/test_kernels.py``)."""
    if any(item.name == "test_the_kernels_under_the_interpreter" for item in session.items):
        from tests.rollout import test_kernels

        test_kernels.start_interpreter_run()


def pytest_sessionfinish(session, exitstatus):
    import sys

    module = sys.modules.get("tests.rollout.test_kernels")
    if module is not None:
        module.stop_interpreter_run()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test that needs the code sandbox skips, with the reason, on a machine where no sandbox can start (no
    bubblewrap, no user namespaces, root without a Python other users can run). Not where SCGRPO_REQUIRE_SANDBOX is
    set (``.ci/run`` sets it once bubblewrap is there): there the failure stands."""
    outcome = yield
    from scgrpo.verifiers.sandbox import SandboxError

    error = outcome.exception
    cause = error
    while cause is not None and not isinstance(cause, SandboxError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and "no sandbox works here" in str(cause) and not os.environ.get("SCGRPO_REQUIRE_SANDBOX"):
        outcome.force_exception(pytest.skip.Exception(f"the code sandbox cannot start here: {cause}",
                                                      _use_item_location=True))


@pytest.fixture
def figures(monkeypatch):
    """The figures a plotting script draws, kept open (its ``plt.close`` does nothing) to be read back after ``plot``."""
    plt = pytest.importorskip("matplotlib.pyplot")
    close = plt.close
    close("all")
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    yield lambda written: dict(zip([os.path.basename(p) for p in written], map(plt.figure, plt.get_fignums())))
    close("all")
