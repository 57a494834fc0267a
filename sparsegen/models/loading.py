"""Load any Hugging Face causal LM (hub id, local folder or GGUF file), a packaged real model or a bundled reference
model, with clear errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from sparsegen.models.compat import no_split_modules
from sparsegen.models.errors import ModelLoadError
from sparsegen.models.rebuild import rebuild, recorded
from sparsegen.models.synthetic import PREFIX, PRESETS, is_random, preset_config

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
BUNDLED = ("reference", "reference-relu", "reference-large")

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve(name_or_path: str | Path) -> str:
    """Turn a bundled name into its folder, and a packaged model name (``smollm2``, ``gemma3-270m``) or a
    ``.gguf`` file into its converted checkpoint (converting on first use); anything else is returned as given
    (a path or a hub id)."""
    from sparsegen.models.gguf import checkpoint_folder, is_gguf_model

    name = str(name_or_path)
    local = Path(name).expanduser()
    looks_local = name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
    if looks_local and not local.exists():
        raise ModelLoadError(f"{name} does not exist; give a checkpoint folder, a .gguf file, a packaged model "
                             f"(smollm2, gemma3-270m, reference) or a hub id such as org/name")
    if looks_local:
        name = str(local)
    if is_gguf_model(name):
        return str(checkpoint_folder(name))
    if name in BUNDLED:
        folder = CHECKPOINTS / name
        if not (folder / "config.json").exists():
            raise ModelLoadError(
                f"the bundled model {name!r} is not in this installation ({folder} has no config.json); "
                f"train it with `sparsegen train-reference --preset {name}`"
            )
        return str(folder)
    return name


def _hub_unreachable_reason() -> str | None:
    """Why the hub cannot be used right now (offline mode or no route), or None if it answers."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as err:
        return f"{host} is unreachable ({err.strerror or err})"
    return None


def load_config(name_or_path: str | Path, **kwargs) -> PretrainedConfig:
    """The model's config from a local folder, the HF cache, or (if reachable) the hub: one clear error otherwise.
    ``random:NAME`` gives a synthetic model's config (``sparsegen.models.synthetic``)."""
    if is_random(name_or_path):  # a preset shape, or any checkpoint's config (its weights ignored)
        key = str(name_or_path).removeprefix(PREFIX)
        config = preset_config(key) if key in PRESETS else load_config(key, **kwargs)
        config.name_or_path = PREFIX + key
        return config
    source = resolve(name_or_path)
    if Path(source).exists():
        if not (Path(source) / "config.json").exists():
            raise ModelLoadError(f"{source} is a local path but has no config.json; point at a saved HF checkpoint "
                                 f"folder")
        return AutoConfig.from_pretrained(source, **kwargs)
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError:
        pass
    reason = _hub_unreachable_reason()
    if reason:
        raise ModelLoadError(
            f"model {source!r} is not a local folder and not in the Hugging Face cache, and the hub cannot be "
            f"reached: {reason}. Download it where the hub is reachable (`hf download {source}`) and copy the "
            f"cache here, or pass the path of a local checkpoint."
        )
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except OSError as err:
        raise ModelLoadError(f"cannot load {source!r} from the hub: {err}") from None


def saved_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (float32 if its config does not say)."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return saved if isinstance(saved, torch.dtype) else DTYPES.get(str(saved).removeprefix("torch."), torch.float32)


def resolve_dtype(dtype: str | torch.dtype | None, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """None picks float32 on CPU (half precision is slow and inexact there) and the checkpoint's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        dtype = "auto"
    if dtype == "auto":
        return saved_dtype(config)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"{device!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    return device


def load(
    name_or_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    tokenizer: bool = True,
    revision: str | None = None,
    device_map: str | dict | None = None,
) -> tuple[torch.nn.Module, object]:
    """Return ``(model, tokenizer)`` for a hub id, a local checkpoint folder, a ``.gguf`` file, a packaged model
    (``smollm2``, ``gemma3-270m``) or a bundled one (``reference``).

    The model is in eval mode on ``device``. ``dtype`` defaults to float32 on CPU and the checkpoint's
    dtype on accelerators. ``tokenizer=False`` loads the model only (the tokenizer comes back as None), e.g. a
    checkpoint compressed from a ``random:`` shape, which has none. ``revision`` (a hub branch, tag or commit) and
    ``device_map`` (``"auto"``, a device, or accelerate's ``{module: device}``; instead of ``device``) go to
    transformers and accelerate; a checkpoint sparsegen rebuilds is read one shard at a time.
    """
    if is_random(name_or_path):
        raise ModelLoadError(f"{name_or_path!r} has random weights and no tokenizer: it is for `sparsegen bench` and "
                             f"`sparsegen info` only; pass a real checkpoint to run text through a model")
    if device_map is not None and str(device) != "cpu":
        raise ValueError("give device or device_map, not both: device_map places every module itself")
    device = check_device(device)
    source = resolve(name_or_path)
    config = load_config(source, revision=revision)
    source_dtype = saved_dtype(config)  # read before loading, which records the dtype it loads in
    local = Path(source).exists() or _is_cached(source)
    kwargs = {"local_files_only": True} if local and not Path(source).exists() else {}
    if revision is not None:
        kwargs["revision"] = revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs) if tokenizer else None
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of {source!r}: {err}") from None
    try:
        if recorded(config):  # layers differ from what the config alone builds
            model = _load_rebuilt(_folder(source, kwargs), config, resolve_dtype(dtype, config, device),
                                  attn_implementation)
            if device_map is not None:
                model = _dispatch(model, device_map)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                source, config=config, dtype=resolve_dtype(dtype, config, device),
                attn_implementation=attn_implementation, device_map=device_map, **kwargs
            )
    except ValueError as err:
        if "Unrecognized configuration class" in str(err):
            raise ModelLoadError(
                f"{source!r} ({config.model_type}) is not a causal language model that transformers can load "
                f"with AutoModelForCausalLM; sparsegen works on decoder-only LMs (Llama, Mistral, Qwen, GPT-NeoX, "
                f"OPT, ...)"
            ) from None
        raise
    except (OSError, RuntimeError, SafetensorError) as err:
        if Path(source).exists():
            raise ModelLoadError(
                f"the checkpoint in {source} could not be read ({type(err).__name__}: {err}); it may be incomplete or "
                f"corrupted: re-download or re-save it"
            ) from None
        raise ModelLoadError(f"cannot load {source!r}: {err}") from None
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.source_dtype = source_dtype  # what a compressed copy is saved in (sparsegen.pruning.save_pruned)
    model.source_reports = _reports(source)  # what was done to it, carried into a compressed copy (save_pruned)
    return (model if device_map is not None else model.to(device)).eval(), tokenizer


REPORTS = ("sparsity.json", "quantization.json")  # what sparsegen's compressed checkpoints say was done to them


def _reports(source: str) -> dict[str, dict]:
    """The compression reports in a local checkpoint folder, by file name."""
    folder = Path(source)
    found = {}
    for name in REPORTS:
        if (folder / name).is_file():
            try:
                found[name] = json.loads((folder / name).read_text())
            except (OSError, ValueError) as err:
                raise ModelLoadError(f"{folder / name} is not readable JSON ({err}): re-save the checkpoint") from None
    return found


def _load_rebuilt(folder: str, config: PretrainedConfig, dtype: torch.dtype,
                  attn_implementation: str | None) -> torch.nn.Module:
    """A checkpoint sparsegen reshaped (structurally pruned and/or quantized): the architecture rebuilt as recorded
    in its config, then its weights loaded, every tensor accounted for."""
    from safetensors.torch import load_file
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    rebuild(model, config)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    loaded, unexpected = set(), set()
    for file in files:  # one shard in memory at a time
        shard = load_file(file)
        unexpected |= set(model.load_state_dict(shard, strict=False).unexpected_keys)
        loaded |= shard.keys()
        del shard
    tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
    missing = set(model.state_dict()) - loaded - tied
    if unexpected or missing:
        raise ValueError(f"the weights in {folder} do not match the layers its config.json records (missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model


def _folder(source: str, kwargs: dict) -> str:
    """A local folder holding the checkpoint: ``source`` itself, or its hub snapshot (config, weights)."""
    if Path(source).exists():
        return source
    from huggingface_hub import snapshot_download

    return snapshot_download(source, allow_patterns=["*.json", "*.safetensors"], **kwargs)


def _dispatch(model: torch.nn.Module, device_map: str | dict) -> torch.nn.Module:
    """Place a rebuilt model's modules as ``device_map`` says, with accelerate (``"auto"``: by free memory)."""
    from accelerate import dispatch_model, infer_auto_device_map

    if device_map == "auto":
        device_map = infer_auto_device_map(model, no_split_module_classes=no_split_modules(model))
    elif not isinstance(device_map, dict):
        device_map = {"": str(check_device(device_map))}
    return dispatch_model(model, device_map)


def _is_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id that is not a valid repo name is simply not cached
        return False
