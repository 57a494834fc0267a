"""Run by `make test-vllm` in sparsegen's own venv: the checkpoints vLLM is asked to serve, and sparsegen's own greedy
tokens on fixed prompts for each, written to ``OUT/expected.json`` for ``test_vllm.py`` (which runs in vLLM's venv).

Usage: python -m tests.vllm.prepare OUT"""

import json
import sys
from pathlib import Path

import torch

from sparsegen.cli import main as sparsegen
from sparsegen.data import data_dir, read_texts
from sparsegen.engine.generate import generate_tokens
from sparsegen.kv import PolicySpec
from sparsegen.kv.policies.full import Full
from sparsegen.models import load
from sparsegen.models.loading import resolve
from sparsegen.models.spec import kv_bytes_per_token
from sparsegen.models.windowed import windowed_checkpoint

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "To make a cup of tea, first"]
NEW_TOKENS = 32
PRUNED = {"wanda50": ["--sparsity", "0.5"], "wanda24": ["--pattern", "2:4"],
          "structured": ["--structured", "neurons=0.25"]}
QUANTIZED = {"int4": ["--bits", "4"], "int8": ["--bits", "8"],  # round to nearest, the default group size (64)
             "int4a8": ["--bits", "4", "--format", "int-quantized"],  # int8 inputs per token
             "int8a8": ["--bits", "8", "--format", "int-quantized"]}  # (one scale per row: W8A8's default)


def checkpoints(out: Path) -> dict[str, str]:
    """dense (the GGUF converted), Wanda 50%, Wanda 2:4, structured-pruned, int4 and int8 (compressed-tensors
    pack-quantized, W4A16 / W8A16), int4a8 and int8a8 (int-quantized, W4A8 / W8A8 dynamic); each written once."""
    made = {"dense": resolve("smollm2")}
    for name, flags in PRUNED.items():
        folder = out / name
        if not (folder / "config.json").exists():
            sparsegen(["prune", "--model", "smollm2", "--method", "wanda", *flags, "--nsamples", "16",
                       "--out", str(folder), "--force"])
        made[name] = str(folder)
    for name, flags in QUANTIZED.items():
        folder = out / name
        if not (folder / "config.json").exists():
            sparsegen(["quantize", "--model", "smollm2", *flags, "--method", "rtn", "--out", str(folder), "--force"])
        made[name] = str(folder)
    return made


WINDOW = 256  # vLLM's sliding window for the windowed checkpoint: sparsegen's window policy holds WINDOW - 1
WINDOW_PROMPT = 1200  # tokens of book text, well past the window
LONG_CONTEXT = 32768  # the windowed checkpoint's positions: a 32K conversation in a pool of far fewer tokens


@torch.inference_mode()
def windowed(out: Path) -> dict:
    """A windowed SmolLM2 (every layer a WINDOW-token sliding window) and sparsegen's greedy tokens under its
    ``window`` policy with WINDOW - 1 held tokens, original positions, on a book excerpt."""
    folder = out / "window"
    if not (folder / "config.json").exists():
        windowed_checkpoint("smollm2", WINDOW, folder, max_context=LONG_CONTEXT, overwrite=True)
    model, tokenizer = load("smollm2")
    texts = read_texts(data_dir() / "books" / "test")
    text = texts[0]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :WINDOW_PROMPT]
    new, *_ = generate_tokens(model, ids, torch.ones_like(ids),
                              PolicySpec("window", WINDOW - 1, positions="original"), max_new_tokens=NEW_TOKENS)
    rows = [{"prompt": f"{WINDOW_PROMPT} tokens of {text[:40]!r}...", "prompt_ids": ids[0].tolist(),
             "tokens": new[0].tolist()}]
    books = tokenizer("\n\n".join(texts), return_tensors="pt")["input_ids"]
    ids = books[:, :LONG_CONTEXT - 2 * NEW_TOKENS]
    if ids.shape[1] < LONG_CONTEXT - 2 * NEW_TOKENS:
        raise RuntimeError(f"the test books hold {books.shape[1]:,} tokens, fewer than a {LONG_CONTEXT:,}-token prompt")
    new, *_ = generate_tokens(model, ids, torch.ones_like(ids),
                              PolicySpec("window", WINDOW - 1, positions="original"), max_new_tokens=NEW_TOKENS)
    long = {"prompt": f"{ids.shape[1]:,} tokens of the test books", "prompt_ids": ids[0].tolist(),
            "tokens": new[0].tolist()}
    return {"path": str(folder), "window": WINDOW, "long_context": LONG_CONTEXT, "rows": rows, "long": long,
            "kv_bytes_per_token": kv_bytes_per_token(model.config, 4)}  # fp32 K/V, as vLLM holds them here


@torch.inference_mode()
def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expected = {"window": windowed(out)}
    for name, path in checkpoints(out).items():
        model, tokenizer = load(path)
        rows = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            new, *_ = generate_tokens(model, ids, torch.ones_like(ids), Full(), max_new_tokens=NEW_TOKENS)
            rows.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "tokens": new[0].tolist()})
        expected[name] = {"path": path, "rows": rows}
    (out / "expected.json").write_text(json.dumps(expected, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
