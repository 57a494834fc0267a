import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsegen.eval.sinks import attention_mask, sink_statistics


def test_attention_mask_rule():
    keep = attention_mask(12, window=4, sinks=2)
    for i in range(12):
        for j in range(12):
            assert keep[i, j] == (j <= i and (j > i - 4 or j < 2))
    assert torch.equal(attention_mask(12), torch.ones(12, 12).tril().bool())


@pytest.fixture(scope="module")
def eager_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()


TOKENS = [np.random.default_rng(0).integers(2, 300, size=2000)]


def test_patterns_agree_when_the_window_covers_everything(eager_model):
    stats = sink_statistics(eager_model, TOKENS, bos_id=0, length=32, min_query=8, scored_from=16,
                            window=64, sinks=4, max_windows=10, progress=False)
    full = stats["ppl"]["full"]
    assert stats["ppl"] == {"full": full, "window_64": full, "sinks_4+window_60": full}


def test_against_a_direct_computation(eager_model):
    stats = sink_statistics(eager_model, TOKENS, bos_id=0, length=32, min_query=8, scored_from=16,
                            window=8, sinks=2, max_windows=10, batch_size=4, progress=False)
    assert stats["windows"] == 10
    body = torch.from_numpy(TOKENS[0][: 2000 // 31 * 31]).view(-1, 31)
    picked = body[np.linspace(0, len(body) - 1, 10).round().astype(int)]
    batch = torch.cat([torch.zeros(10, 1, dtype=torch.long), picked], dim=1)
    with torch.no_grad():
        out = eager_model(input_ids=batch, output_attentions=True)
    nll = torch.nn.functional.cross_entropy(out.logits[:, 15:-1].flatten(0, 1), batch[:, 16:].flatten())
    assert stats["ppl"]["full"] == pytest.approx(float(torch.exp(nll)), rel=1e-4)
    mass = [a[:, :, 8:, 0].mean().item() for a in out.attentions]
    assert stats["mass_on_token0_per_layer"] == pytest.approx(mass, abs=1e-5)
    assert stats["ppl"]["window_8"] != stats["ppl"]["full"]
    assert stats["uniform_mass"] == pytest.approx(np.mean([1 / (q + 1) for q in range(8, 32)]), abs=1e-5)


def test_needs_eager_attention(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="sdpa").eval()
    with pytest.raises(ValueError, match="eager"):
        sink_statistics(model, TOKENS, bos_id=0, length=32, min_query=8, scored_from=16, max_windows=2, progress=False)
