"""Tiny random models of every family the eviction engine supports."""

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gqa(**kw):
    return {**COMMON, "intermediate_size": 48, "num_key_value_heads": 2, **kw}


FAMILIES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_gqa())),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**_gqa(sliding_window=None))),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_gqa())),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**_gqa(head_dim=16))),
    # two sliding-window layers (window 6, their own RoPE base) and one global layer, QK-norm
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(**_gqa(
        head_dim=16, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))),
    "gpt_neox": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(**{**COMMON, "intermediate_size": 48,
                                                              "rotary_pct": 0.25})),
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**_gqa())),
    "opt": (OPTForCausalLM, lambda: OPTConfig(**{**COMMON, "ffn_dim": 48, "word_embed_proj_dim": 32,
                                                 "enable_bias": True})),
}
ROPE_FAMILIES = [f for f in FAMILIES if f != "opt"]


def tiny_model(family: str, attn: str = "sdpa", dtype=torch.float32, seed: int = 0):
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls._from_config(config(), attn_implementation=attn, dtype=dtype)
    return model.eval()


def _builds_from_a_name(cls) -> bool:
    from sparsegen.kv.policy import policy_options

    return "scorer" not in policy_options(cls)


def named_policies() -> dict:
    """Every registered policy a name and a budget build alone: all but those that need a fitted file (kvzap's
    scorer, tested with one fitted in ``tests/kv/test_kvzap.py``)."""
    from sparsegen.kv import POLICIES

    return {name: cls for name, cls in POLICIES.items() if _builds_from_a_name(cls)}
