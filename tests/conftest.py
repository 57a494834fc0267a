"""Shared fixtures: tiny random models saved as real HF checkpoints, and a tiny text corpus."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsegen.reference.tokenizer import train_tokenizer

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair.\n"
) * 40


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def compiled_step_batches(monkeypatch) -> list[int]:
    """Compiled steps, regional and whole, go through dynamo with backend "eager" (the capture and the output are
    checked, not a kernel): the batch size of every step that ran compiled, in order (a regional step's once a
    block)."""
    import sparsegen.engine.step as decoding

    torch._dynamo.reset()
    batches = []
    whole = torch.compile(decoding._step, fullgraph=True, backend="eager")
    block = torch.compile(decoding.run_block, fullgraph=True, backend="eager")

    def step(model, cache, token, position):
        batches.append(token.shape[0])
        return whole(model, cache, token, position)

    def run_block(layers, hidden, calls):
        batches.append(hidden.shape[0])
        return block(layers, hidden, calls)

    monkeypatch.setattr(decoding, "_compiled_step", lambda graphs: step)
    monkeypatch.setattr(decoding, "_compiled_block", lambda: run_block)
    return batches


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A folder laid out like ../shared/data, with a little text in each place."""
    root = tmp_path_factory.mktemp("data")
    for sub in ("books/train", "books/test", "wikitext-2-raw"):
        (root / sub).mkdir(parents=True)
    (root / "books/train/a.txt").write_text(TEXT)
    (root / "books/train/b.txt").write_text(TEXT.upper())
    (root / "books/test/c.txt").write_text(TEXT.replace("times", "days"))
    (root / "wikitext-2-raw/wiki.test.raw").write_text(TEXT.replace("was", "is"))
    return root


@pytest.fixture(scope="session")
def tiny_tokenizer(corpus):
    return train_tokenizer(sorted((corpus / "books/train").glob("*.txt")), vocab_size=300)


def tiny_llama_config(vocab_size: int, **overrides) -> LlamaConfig:
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return LlamaConfig(**{**settings, **overrides})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    """A random 2-layer GQA Llama and its tokenizer, saved with save_pretrained (fp32 safetensors)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(len(tiny_tokenizer))).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
