"""A checkpoint that asks a serving engine for a sliding-window KV cache (sparsegen's ``window`` policy), in the form
vLLM reads: every layer ``sliding_attention`` with ``sliding_window`` tokens. vLLM then gives each sequence a
sliding-window KV spec and frees the blocks that fall out of the window, so it serves conversations longer than its KV
pool (its scheduler reserves a window plus a prefill chunk per sequence, not the whole length).

This is the nearest StreamingLLM gets to vLLM 0.32 without a fork: its KV-cache managers are picked from a closed
map of spec types (``vllm.v1.core.single_type_kv_cache_manager.spec_manager_map``: no plugin can add a "sinks + window"
manager that keeps the first block), and its attention kernels take one contiguous window per layer
(``sliding_window``), not a window plus pinned sink tokens. Without sinks, a window over original positions is
StreamingLLM's "window attention" baseline: exact against sparsegen's ``window`` policy, not against ``streaming``.

transformers' own Llama ignores these fields (it has no sliding layers): load the source model in sparsegen with
``--policy window`` for the same behaviour.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sparsegen.models.loading import resolve
from sparsegen.output import check_output, new_folder

# model types whose vLLM implementation reads ``layer_types``/``sliding_window`` per layer (checked in vLLM 0.32)
WINDOWED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def windowed_config(config: dict, window: int, max_context: int | None = None) -> dict:
    """``config`` (a config.json's fields) with every layer a sliding-window layer of ``window`` tokens, each query
    seeing itself and the ``window - 1`` tokens before it; ``max_context`` raises the positions an engine may serve
    (RoPE as trained, extrapolated past its trained length, as sparsegen's ``--positions original``)."""
    kind = config.get("model_type")
    if kind not in WINDOWED_TYPES:
        raise ValueError(f"a {kind!r} checkpoint cannot be windowed: vLLM reads per-layer windows for "
                         f"{', '.join(WINDOWED_TYPES)} (Gemma 3 has its own sliding layers already)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"--window must be a whole number of tokens >= 2, got {window!r}")
    out = {**config, "sliding_window": window, "use_sliding_window": True,
           "layer_types": ["sliding_attention"] * config["num_hidden_layers"], "max_window_layers": 0}
    if max_context is not None:
        if max_context < window:
            raise ValueError(f"--max-context {max_context} is shorter than the window {window}")
        out["max_position_embeddings"] = max(max_context, config.get("max_position_embeddings", 0))
    return out


def windowed_checkpoint(model: str, window: int, out: str | Path, max_context: int | None = None,
                        overwrite: bool = False) -> Path:
    """Write ``model`` (a checkpoint folder or a packaged name) to ``out`` with a windowed config; the weights are
    copied as they are. Returns ``out``."""
    source = Path(resolve(model))
    if not (source / "config.json").exists():
        raise ValueError(f"{model} is not a local checkpoint folder (no config.json in {source})")
    config = windowed_config(json.loads((source / "config.json").read_text()), window, max_context)
    out = check_output(out, source, overwrite)
    with new_folder(out, overwrite) as folder:
        for file in source.iterdir():
            if file.is_file() and file.name != "config.json":
                shutil.copy2(file, folder / file.name)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
