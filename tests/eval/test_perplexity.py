import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsegen.eval.perplexity import window_perplexity, windows


def test_windows_drop_tails_and_short_texts():
    data = windows([np.arange(10), np.arange(3), np.arange(8)], 4)
    assert data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="at least 5 tokens"):
        windows([np.arange(3)], 5)


@pytest.mark.parametrize("bos", [None, 0])
def test_matches_the_models_own_loss(tiny_checkpoint, bos):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    tokens = [np.random.default_rng(1).integers(2, 300, size=200)]
    result = window_perplexity(model, tokens, ctx=32, bos_id=bos, batch_size=3, progress=False)
    data = windows(tokens, 31 if bos is not None else 32)
    if bos is not None:
        data = torch.cat([torch.full((len(data), 1), bos), data], dim=1)
    with torch.no_grad():
        losses = [model(input_ids=row[None], labels=row[None]).loss.item() for row in data]
    assert result["tokens"] == len(data) * 31
    assert result["nll"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_a_large_vocabulary_gets_fewer_windows_per_forward(tiny_checkpoint, monkeypatch):
    """Logits are capped per forward (Gemma's 262K vocabulary made 8 windows of 1,024 tokens 8 GiB): the same
    perplexity, in more, smaller calls."""
    import sparsegen.eval.perplexity as perplexity

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    tokens = [np.random.default_rng(1).integers(2, 300, size=200)]
    whole = window_perplexity(model, tokens, ctx=32, batch_size=6, progress=False)
    calls = []
    model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape[0]),
                                with_kwargs=True)
    monkeypatch.setattr(perplexity, "LOGIT_BYTES", 2 * 32 * model.config.vocab_size * 4)
    capped = window_perplexity(model, tokens, ctx=32, batch_size=6, progress=False)
    assert max(calls) == 2 and capped["nll"] == pytest.approx(whole["nll"], rel=1e-6)


@pytest.mark.parametrize("bos", [None, 0])
def test_llama_cpps_protocol_scores_the_second_half_of_each_window(tiny_checkpoint, bos):
    """llama-perplexity's protocol, against a plain reference: each window of ctx consecutive tokens, its first
    token replaced by BOS, the predictions of positions ctx/2 .. ctx-2 scored from the whole window's logits."""
    from sparsegen.eval.perplexity import second_half_perplexity

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    tokens = np.random.default_rng(2).integers(2, 300, size=150)
    result = second_half_perplexity(model, tokens, ctx=32, bos_id=bos, batch_size=2, progress=False)
    losses = []
    with torch.no_grad():
        for start in range(0, 150 // 32 * 32, 32):
            row = torch.from_numpy(tokens[start:start + 32].copy())
            if bos is not None:
                row[0] = bos
            logits = model(input_ids=row[None]).logits[0]
            losses += [-torch.log_softmax(logits[j], -1)[row[j + 1]].item() for j in range(16, 31)]
    assert result["windows"] == 4 and result["tokens"] == len(losses) == 4 * 15
    assert result["nll"] == pytest.approx(np.mean(losses), rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 x ctx"):
        second_half_perplexity(model, tokens[:60], ctx=32, progress=False)
