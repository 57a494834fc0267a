"""The numbers docs/reference-model.md gives for a reference model: held-out perplexity and its attention-sink
statistics."""

from __future__ import annotations

import json
from pathlib import Path

from sparsegen.data import data_dir, tokenize_files
from sparsegen.eval.perplexity import window_perplexity
from sparsegen.eval.sinks import sink_statistics
from sparsegen.models import load


def reference_report(checkpoint: str | Path, device: str = "cpu", progress: bool = True) -> dict:
    """Perplexity on books/test and wiki.test.raw (windows of the trained context, BOS first) and sink statistics."""
    model, tokenizer = load(str(checkpoint), device=device, attn_implementation="eager")
    ctx = model.config.max_position_embeddings
    root = data_dir()
    books = tokenize_files(root / "books" / "test", tokenizer)
    wiki = tokenize_files(root / "wikitext-2-raw" / "wiki.test.raw", tokenizer)
    model.set_attn_implementation("sdpa")
    report = {
        "ppl_books_test": window_perplexity(model, books, ctx, tokenizer.bos_token_id, progress=progress),
        "ppl_wikitext2_test": window_perplexity(model, wiki, ctx, tokenizer.bos_token_id, progress=progress),
    }
    model.set_attn_implementation("eager")
    report["sinks_books_test"] = sink_statistics(model, books, tokenizer.bos_token_id, progress=progress)
    return report


def write_report(checkpoint: str | Path, device: str = "cpu") -> dict:
    report = reference_report(checkpoint, device)
    (Path(checkpoint) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
