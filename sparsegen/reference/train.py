"""Train the project's own reference model: a small Llama (RoPE, SwiGLU, GQA) on the training books.

Reproducible (seeded model init and batch sampling), resumable (a training state is written every
``checkpoint_every`` steps to the work folder), and exported as a plain Hugging Face checkpoint that
``AutoModelForCausalLM.from_pretrained`` loads with no code of ours.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sparsegen.data import data_dir, text_files, tokenize_files
from sparsegen.output import new_folder
from sparsegen.reference.tokenizer import train_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    context: int
    batch_size: int
    steps: int
    lr: float
    vocab_size: int = 8192
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    grad_clip: float = 1.0
    rope_theta: float = 10000.0
    act: str = "silu"  # the MLP's gate activation: "relu" gives the natively sparse MLP Deja Vu exploits
    seed: int = 0


PRESETS = {
    # ~6.6M parameters; ~4M tokens in about 40 minutes on 2 CPU cores.
    "reference": TrainConfig(hidden_size=256, layers=6, heads=8, kv_heads=2, intermediate_size=768,
                             context=512, batch_size=8, steps=1000, lr=2e-3),
    # the same model and data with a ReLU gate, for contextual sparsity (Deja Vu's native MLP sparsity)
    "reference-relu": TrainConfig(hidden_size=256, layers=6, heads=8, kv_heads=2, intermediate_size=768,
                                  context=512, batch_size=8, steps=1000, lr=2e-3, act="relu"),
    # ~28M parameters, context 1024, ~330M tokens: a GPU run, long enough for attention sinks to form.
    "reference-large": TrainConfig(hidden_size=512, layers=8, heads=8, kv_heads=2, intermediate_size=1536,
                                   context=1024, batch_size=64, steps=5000, lr=1e-3),
}


def model_config(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context,
        rope_theta=cfg.rope_theta,
        hidden_act=cfg.act,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_fraction`` of the peak."""
    warmup = max(1, int(cfg.warmup_fraction * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def token_stream(tokenizer: PreTrainedTokenizerFast, files_root: Path) -> np.ndarray:
    """All training books as one stream, an EOS between books."""
    arrays = tokenize_files(files_root, tokenizer)
    eos = np.asarray([tokenizer.eos_token_id], dtype=arrays[0].dtype)
    return np.concatenate([x for a in arrays for x in (a, eos)])


def sample_batch(stream: np.ndarray, cfg: TrainConfig, bos_id: int, rng: np.random.Generator) -> torch.Tensor:
    """``batch_size`` random windows, each ``[BOS] + context-1`` tokens: every sequence starts with BOS."""
    body = cfg.context - 1
    starts = rng.integers(0, len(stream) - body, size=cfg.batch_size)
    rows = np.stack([stream[s : s + body] for s in starts]).astype(np.int64)
    return torch.cat([torch.full((cfg.batch_size, 1), bos_id), torch.from_numpy(rows)], dim=1)


def train_reference(
    out_dir: str | Path,
    preset: str = "reference",
    work_dir: str | Path | None = None,
    device: str = "cpu",
    compile: bool = True,
    checkpoint_every: int = 50,
    threads: int | None = None,
    stop_after: int | None = None,
    **overrides,
) -> dict | None:
    """Train (or resume) a reference model and export it to ``out_dir``; returns the training record.

    ``stop_after`` ends this run after that many steps, with its state saved, for time-sliced training;
    the call then exports nothing and returns None.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    out_dir = Path(out_dir)
    work_dir = Path(work_dir or Path("runs") / preset)
    work_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    train_root = data_dir() / "books" / "train"
    tokenizer = _tokenizer(work_dir / "tokenizer", cfg, train_root)
    stream = token_stream(tokenizer, train_root)
    print(f"training stream: {len(stream):,} tokens", flush=True)
    model = LlamaForCausalLM(model_config(cfg, tokenizer)).to(device)
    optimizer = _optimizer(model, cfg, device)
    rng = np.random.default_rng(cfg.seed)
    state_file = work_dir / "train_state.pt"
    step, elapsed = _resume(state_file, model, optimizer, rng, cfg, device)
    forward = torch.compile(model) if compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    tokens_per_step = cfg.batch_size * cfg.context
    log = (work_dir / "log.jsonl").open("a")
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {preset}", unit="step")
    model.train()
    last_step = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    while step < last_step:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        batch = sample_batch(stream, cfg, tokenizer.bos_token_id, rng).to(device)
        with autocast:
            loss = forward(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        step, dt = step + 1, time.perf_counter() - t0
        elapsed += dt
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        log.write(json.dumps({"step": step, "loss": loss_value, "lr": learning_rate(cfg, step - 1),
                              "tokens_per_s": tokens_per_step / dt}) + "\n")
        if step % checkpoint_every == 0 or step == last_step:
            log.flush()
            _save_state(state_file, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                     "rng": rng.bit_generator.state, "step": step, "elapsed": elapsed,
                                     "config": asdict(cfg)})
    bar.close()
    log.close()
    if step < cfg.steps:
        return None
    record = {
        "preset": preset, "config": asdict(cfg), "params": sum(p.numel() for p in model.parameters()),
        "training_tokens": cfg.steps * tokens_per_step, "training_stream_tokens": int(len(stream)),
        "train_seconds": round(elapsed, 1),
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "compiled": compile,
    }
    _export(out_dir, model, tokenizer, record)
    return record


def _tokenizer(folder: Path, cfg: TrainConfig, train_root: Path) -> PreTrainedTokenizerFast:
    """The run's byte-level BPE: trained on the training books once, then loaded from ``folder``."""
    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    print(f"training a {cfg.vocab_size}-token byte-level BPE on {train_root} ...", flush=True)
    tokenizer = train_tokenizer(text_files(train_root), cfg.vocab_size)
    tokenizer.save_pretrained(folder)
    return tokenizer


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"),
    )


def _resume(state_file: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: np.random.Generator,
            cfg: TrainConfig, device: str) -> tuple[int, float]:
    """Load the saved training state, if any, into the model, optimizer and sampler; its step and seconds spent."""
    if not state_file.exists():
        return 0, 0.0
    state = torch.load(state_file, map_location=device, weights_only=True)  # tensors and plain data only
    if state["config"] != asdict(cfg):
        raise ValueError(f"{state_file} was written with other settings; delete it or use another --work")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["rng"]
    print(f"resuming at step {state['step']}", flush=True)
    return state["step"], state["elapsed"]


def _save_state(state_file: Path, state: dict) -> None:
    partial = state_file.with_suffix(".partial")  # a kill mid-write leaves the last good state
    torch.save(state, partial)
    partial.replace(state_file)


def _export(out_dir: Path, model: torch.nn.Module, tokenizer, record: dict) -> None:
    """The trained model in fp16 with its tokenizer and training record; the folder is replaced whole, once complete."""
    with new_folder(out_dir, overwrite=True) as work:
        model.eval()
        model.to(torch.float16).save_pretrained(work)
        tokenizer.save_pretrained(work)
        # The generic class name loads on every transformers release; loading-time keys do not belong in the file.
        tok_cfg = work / "tokenizer_config.json"
        settings = {k: v for k, v in json.loads(tok_cfg.read_text()).items()
                    if k not in ("is_local", "local_files_only")}
        tok_cfg.write_text(json.dumps({**settings, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        (work / "training.json").write_text(json.dumps(record, indent=2) + "\n")
