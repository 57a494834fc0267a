"""The bundled reference model: a plain HF checkpoint that loads without sparsegen and generates deterministically."""

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sparsegen
from sparsegen.models.loading import CHECKPOINTS

REFERENCE = CHECKPOINTS / "reference"


def test_loads_with_plain_transformers():
    model = AutoModelForCausalLM.from_pretrained(REFERENCE)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert config.max_position_embeddings == 512
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 15e6
    assert len(tokenizer) == config.vocab_size == 8192
    ids = tokenizer("The old man").input_ids
    assert ids[0] == tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The old man"


def test_greedy_generation_is_deterministic_and_matches_argmax_decoding():
    model, tokenizer = sparsegen.load("reference")
    prompt = "It was a dark night, and the"
    first = sparsegen.generate(model, tokenizer, prompt, max_new_tokens=24, stop_at_eos=False).text
    assert first == sparsegen.generate(model, tokenizer, prompt, max_new_tokens=24, stop_at_eos=False).text
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(24):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    manual = tokenizer.decode(ids[0], skip_special_tokens=True)
    assert manual == prompt + first
    assert len(first.split()) >= 10  # real words, not an empty or special-token continuation


def test_report_is_present_and_says_what_the_docs_say():
    report = json.loads((REFERENCE / "report.json").read_text())
    training = json.loads((REFERENCE / "training.json").read_text())
    readme = (Path(__file__).parents[2] / "docs" / "reference-model.md").read_text()

    def quoted(row: str) -> str:
        return re.search(re.escape(row) + r"[^|\n]*\| \*\*([\d.,M]+)", readme).group(1)

    assert quoted("PPL, `books/test`") == f"{report['ppl_books_test']['ppl']:.1f}"
    assert quoted("PPL, `wikitext-2-raw/wiki.test.raw`") == f"{report['ppl_wikitext2_test']['ppl']:,.0f}"
    assert f"**{training['training_tokens'] / 1e6:.2f}M tokens**" in readme
    assert len(report["sinks_books_test"]["mass_on_token0_per_layer"]) == 6


def test_info_reference(capsys):
    from sparsegen.cli import main

    assert main(["info", "reference", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_heads"] == 2 and info["heads"] == 8 and info["max_positions"] == 512
    assert info["kv_bytes_per_token"] == 2 * 6 * 2 * 32 * 2  # fp16 checkpoint


@pytest.mark.slow
def test_report_reproduces():
    """Recompute the documented numbers from the checkpoint (minutes on CPU)."""
    from sparsegen.reference.report import reference_report

    saved = json.loads((REFERENCE / "report.json").read_text())
    fresh = reference_report(REFERENCE, progress=False)
    assert fresh["ppl_books_test"]["ppl"] == pytest.approx(saved["ppl_books_test"]["ppl"], rel=1e-4)
    assert fresh["sinks_books_test"]["ppl"] == pytest.approx(saved["sinks_books_test"]["ppl"], rel=1e-4)
