from transformers import OPTConfig

from sparsegen.models import model_spec
from sparsegen.models.spec import spec_from_config


def test_spec_of_gqa_llama(tiny_checkpoint):
    spec = model_spec(str(tiny_checkpoint))
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim) == (2, 4, 2, 8)
    assert spec.positions == "rope"
    assert spec.max_positions == 128
    assert spec.dtype == "float32"
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # K and V, layers, kv heads, head dim, fp32
    assert model_spec(str(tiny_checkpoint), dtype="bf16").kv_bytes_per_token == spec.kv_bytes_per_token // 2


def test_param_count_matches_a_built_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert model_spec(str(tiny_checkpoint)).params == sum(p.numel() for p in model.parameters())


def test_learned_positions_and_mha():
    config = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, ffn_dim=128, vocab_size=100,
                       max_position_embeddings=256, word_embed_proj_dim=64)
    spec = spec_from_config(config, "opt-tiny")
    assert spec.positions == "learned"
    assert spec.kv_heads == spec.heads == 4
    assert spec.kv_bytes_per_token == 2 * 3 * 4 * 16 * 4
