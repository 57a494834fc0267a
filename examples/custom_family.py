"""A model family of your own, in one file: IBM's Granite 3 (``model_type`` "granite") is a Llama-shaped decoder
with scaled embeddings, residuals and attention, which transformers runs through its attention interface; one
``register_family`` call is all sparsegen needs to evict, prune and skip in it:

    python examples/custom_family.py
    sparsegen --plugin examples/custom_family.py generate --model ibm-granite/granite-3.1-2b-instruct ...
"""

from sparsegen.models import Family, register_family

GRANITE = register_family(Family("granite", separate_heads=True))  # a gated MLP (gate, up, down), q/k/v/o by heads


if __name__ == "__main__":
    import torch
    from transformers import DynamicCache, GraniteConfig, GraniteForCausalLM

    from sparsegen import cache_kwargs
    from sparsegen.kv import EvictionCache, make_policy

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.2,
                                             embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0))
    ids = torch.randint(3, 97, (1, 40))
    with torch.no_grad():
        dense = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits
        full = model(ids, **cache_kwargs(EvictionCache(model, make_policy("full")))).logits
        cache = EvictionCache(model, make_policy("streaming", 16))
        model(ids, **cache_kwargs(cache))
    print(f"granite: full cache == transformers' own (max |diff| {(full - dense).abs().max():.1e}); "
          f"streaming holds {max(cache.held_tokens())} of 40 tokens")
