"""sparsegen.load puts on a model what the commands put on it: run-time weights, a contextual plan, a prompt."""

import pytest
import torch

import sparsegen
from sparsegen.models.anatomy import pinned_tokens


def test_load_restores_weights_and_puts_a_prompt():
    plain, tokenizer = sparsegen.load("reference")
    model, _ = sparsegen.load("reference", weights="int8", hard_prompt="A story: ")
    assert pinned_tokens(model) >= 3 and pinned_tokens(plain) == 0  # the prompt's tokens, never evicted
    assert not any(type(m) is torch.nn.Linear for m in model.get_decoder().layers.modules())  # re-stored linears
    ids = torch.tensor([tokenizer("It was a dark night")["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert sparsegen.generate(model, tokenizer, "It was a dark night", max_new_tokens=4, stop_at_eos=False).new_tokens == [4]


def test_load_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="soft prompt or a hard prompt"):
        sparsegen.load("reference", soft_prompt="p.safetensors", hard_prompt="x")
    with pytest.raises(ValueError, match="must be one of"):
        sparsegen.load("reference", weights="int3")
    with pytest.raises(sparsegen.ModelLoadError, match="not a GGUF model"):
        sparsegen.load("reference", weights="gguf")
