"""Where the project's text lives, and turning it into cached token arrays.

The shared corpus sits at ``../shared/data`` beside the checkout; ``SPARSEGEN_DATA`` overrides it.
Token arrays are cached as ``uint16``/``uint32`` ``.npy`` files keyed by the text files and the tokenizer,
so re-tokenising 46 MB of books happens once per machine.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("SPARSEGEN_CACHE", PROJECT_ROOT / ".cache"))


def data_dir() -> Path:
    """The shared data folder (``$SPARSEGEN_DATA``, else ``../shared/data`` beside the project or the cwd)."""
    candidates = []
    if os.environ.get("SPARSEGEN_DATA"):
        candidates.append(Path(os.environ["SPARSEGEN_DATA"]))
    candidates += [PROJECT_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data",
                   Path.cwd() / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        "cannot find the shared data folder; looked in "
        + ", ".join(str(c) for c in candidates)
        + ". Set SPARSEGEN_DATA to the folder that holds books/ and wikitext-2-raw/."
    )


def text_files(path: str | Path) -> list[Path]:
    """A text file, or every ``*.txt``/``*.raw`` file under a folder, sorted for reproducibility."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".raw"} and p.is_file())
        if files:
            return files
        raise FileNotFoundError(f"no .txt or .raw files under {path}")
    raise FileNotFoundError(f"no such file or folder: {path}")


def read_texts(path: str | Path) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in text_files(path)]


def leading_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts it in front of every text (as Llama's does), else None."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("a")["input_ids"][0] == bos else None


def tokenize_files(path: str | Path, tokenizer, cache: bool = True) -> list[np.ndarray]:
    """One token array per text file (no special tokens), cached on disk by content and tokenizer."""
    files = text_files(path)
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    key = hashlib.sha256()
    key.update(tokenizer.backend_tokenizer.to_str().encode())
    for f in files:
        key.update(str(f.resolve()).encode())
        key.update(str(f.stat().st_size).encode())
        key.update(str(f.stat().st_mtime_ns).encode())
    cache_file = CACHE_DIR / "tokens" / f"{key.hexdigest()[:20]}.npz"
    if cache and cache_file.exists():
        with np.load(cache_file) as saved:
            return [saved[f"a{i}"] for i in range(len(files))]
    encodings = tokenizer.backend_tokenizer.encode_batch(
        [f.read_text(encoding="utf-8", errors="replace") for f in files], add_special_tokens=False
    )
    arrays = [np.asarray(e.ids, dtype=dtype) for e in encodings]
    if cache:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache_file, **{f"a{i}": a for i, a in enumerate(arrays)})
    return arrays
