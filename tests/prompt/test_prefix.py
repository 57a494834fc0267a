import pytest
import torch
from transformers import DynamicCache

from sparsegen.engine.generate import generate_tokens
from sparsegen.kv import EvictionCache, make_policy
from sparsegen.models.compat import cache_kwargs
from sparsegen.prompt import PromptPrefix, attach, detach
from tests.kv.families import FAMILIES, VOCAB, tiny_model


def _ids(batch=2, length=20, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _prefix(model, k=5, seed=1):
    hidden = model.get_input_embeddings().weight.shape[1]
    return PromptPrefix(torch.randn(k, hidden, generator=torch.Generator().manual_seed(seed)) * 0.1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_logits_equal_the_plain_model_fed_the_embeddings_first(family):
    model = tiny_model(family)
    ids, prefix = _ids(), _prefix(model)
    embeds = torch.cat([prefix.embeddings[None].expand(2, -1, -1), model.get_input_embeddings()(ids)], dim=1)
    with torch.no_grad():
        reference = model(inputs_embeds=embeds).logits[:, prefix.length:]
        attach(model, prefix)
        assert torch.allclose(model(input_ids=ids).logits, reference, atol=1e-5)
        detach(model)
        embedded = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
        assert torch.allclose(model(input_ids=ids).logits, embedded)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_zero_length_prefix_equals_the_plain_model(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        attach(model, PromptPrefix(torch.zeros(0, model.get_input_embeddings().weight.shape[1])))
        assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "opt"])
def test_generation_with_a_prefix_equals_a_dense_cache_loop_over_prepended_embeddings(family):
    """Chunked prefill of a left-padded batch, then decode, through the full EvictionCache: the same tokens and
    logits as transformers' own cache fed [prefix, text] as embeddings (the independent reference)."""
    model = tiny_model(family)
    prefix = _prefix(model)
    ids = _ids(length=13)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second row is 4 tokens shorter
    new_tokens = 6
    with torch.no_grad():
        expected = []
        for row in range(2):
            text = ids[row:row + 1, mask[row].bool()]
            embeds = torch.cat([prefix.embeddings[None], model.get_input_embeddings()(text)], dim=1)
            cache = DynamicCache(config=model.config)
            logits = model(inputs_embeds=embeds, **cache_kwargs(cache)).logits[:, -1]
            tokens = []
            for _ in range(new_tokens):
                token = logits.argmax(-1)
                tokens.append(int(token))
                logits = model(input_ids=token[:, None], **cache_kwargs(cache)).logits[:, -1]
            expected.append(tokens)
        attach(model, prefix)
        new, *_ = generate_tokens(model, ids, mask, make_policy("full"), max_new_tokens=new_tokens, chunk_size=4)
    assert new.tolist() == expected


@pytest.mark.parametrize("policy", ["window", "streaming", "h2o", "streaming-h2o"])
@pytest.mark.parametrize("padded", [False, True])
def test_prefix_tokens_are_never_evicted(policy, padded):
    model = tiny_model("llama")
    k, budget = 6, 10
    attach(model, _prefix(model, k))
    ids = _ids(length=30)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :7] = 0
    cache = EvictionCache(model, make_policy(policy, budget), chunk_size=8)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for start in range(0, 30, 8):  # chunked prefill, then one token at a time
            model(input_ids=ids[:, start:start + 8], attention_mask=mask[:, :start + 8],
                  position_ids=positions[:, start:start + 8], **cache_kwargs(cache))
        for step in range(12):
            model(input_ids=ids[:, step:step + 1], attention_mask=torch.cat([mask, torch.ones(2, step + 1)], 1).long(),
                  position_ids=positions[:, -1:] + step + 1, **cache_kwargs(cache))
    for layer in cache.layers:
        assert layer.used <= budget + 1
        for row in range(2):
            for head in range(layer.index.shape[1]):
                held = layer.index[row, head, :layer.used][layer.valid[row, head, :layer.used]].tolist()
                assert set(range(k)) <= set(held)
                assert len(held) == budget


def test_a_budget_that_cannot_hold_the_prefix_is_refused():
    model = tiny_model("llama")
    attach(model, _prefix(model, 8))
    with pytest.raises(ValueError, match="raise the budget above 8"):
        EvictionCache(model, make_policy("streaming", 8))


def test_prefix_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="another model"):
        attach(model, PromptPrefix(torch.zeros(4, 7)))
    attach(model, _prefix(model))
    with pytest.raises(ValueError, match="already has a prompt prefix"):
        attach(model, _prefix(model))
    with pytest.raises(ValueError, match="2D padding mask"):
        model(input_ids=_ids(), attention_mask=torch.ones(2, 1, 20, 20))
    assert torch.isfinite(model(input_ids=_ids()).logits).all()  # a failed call leaves the model usable


def test_save_load_round_trip_and_bad_files(tmp_path):
    from safetensors.torch import save_file

    prefix = PromptPrefix(torch.randn(4, 32), {"kind": "soft", "steps": 3})
    loaded = PromptPrefix.load(prefix.save(tmp_path / "p.safetensors"))
    assert torch.equal(loaded.embeddings, prefix.embeddings) and loaded.info == prefix.info
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a sparsegen prompt"):
        PromptPrefix.load(tmp_path / "other.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "p.safetensors").read_bytes()[:50])
    with pytest.raises(ValueError, match="truncated"):
        PromptPrefix.load(tmp_path / "cut.safetensors")
    with pytest.raises(FileNotFoundError, match="prompt-tune"):
        PromptPrefix.load(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_padded_batch_with_explicit_positions_sees_the_prefix_before_its_first_real_token(family):
    model = tiny_model(family)
    prefix = _prefix(model)
    ids = _ids(length=12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = []
        for row in range(2):
            text = ids[row:row + 1, mask[row].bool()]
            embeds = torch.cat([prefix.embeddings[None], model.get_input_embeddings()(text)], dim=1)
            reference.append(model(inputs_embeds=embeds).logits[0, prefix.length:])
        attach(model, prefix)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    for row in range(2):
        assert torch.allclose(logits[row, mask[row].bool()], reference[row], atol=1e-5)


def test_an_attached_prompt_is_not_part_of_the_model_and_follows_it_across_dtypes():
    model = tiny_model("llama")
    keys, count = set(model.state_dict()), sum(1 for _ in model.parameters())
    prefix = _prefix(model)
    attach(model, prefix)
    assert set(model.state_dict()) == keys and sum(1 for _ in model.parameters()) == count
    with torch.no_grad():
        assert model.to(torch.float64)(input_ids=_ids()).logits.dtype == torch.float64  # the hook casts the prompt
    detach(model)
    assert set(model.state_dict()) == keys


def test_fitting_a_predictor_leaves_the_global_random_state_alone():
    from sparsegen.contextual.dejavu import DejaVuConfig, train_predictor

    x, labels = torch.randn(64, 8), torch.rand(64, 16) > 0.5
    state = torch.random.get_rng_state()
    train_predictor(x, labels, 2, DejaVuConfig(sparsity=0.5, epochs=1))
    assert torch.equal(torch.random.get_rng_state(), state)
