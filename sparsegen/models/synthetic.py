"""Real architectures with random weights (``random:llama-1b``): decode speed does not depend on weight values,
so these size hardware for models whose weights are not at hand.

``random:NAME`` is one of ``PRESETS`` (shapes copied from the public configs); ``random:PATH_OR_ID`` takes
the config of any checkpoint and ignores its weights.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

PREFIX = "random:"

_LLAMA2 = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-1b": ("llama", dict(  # Llama-3.2-1B
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama-3b": ("llama", dict(  # Llama-3.2-3B
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama2-7b": ("llama", _LLAMA2),
    "mistral-7b": ("mistral", dict(  # Mistral-7B-v0.3 (no sliding window)
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32768, max_position_embeddings=32768, sliding_window=None, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "pythia-1b": ("gpt_neox", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8, vocab_size=50304,
        max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)),
    "opt-1.3b": ("opt", dict(
        hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32, vocab_size=50272,
        max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True)),
}


def is_random(name: str) -> bool:
    return str(name).startswith(PREFIX)


def preset_config(key: str) -> PretrainedConfig:
    """The config of a preset shape (``PRESETS``), in the dtype it is published in."""
    model_type, settings = PRESETS[key]
    return AutoConfig.for_model(model_type, dtype="bfloat16", **settings)


def random_model(config: PretrainedConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> torch.nn.Module:
    """Build the model ``config`` describes (``load_config("random:NAME")``) on ``device`` without running the (slow)
    weight initialisation, then fill it cheaply: normal(0, 0.02) matrices, unit norms, zero biases. Buffers (rotary
    frequencies) are computed as usual."""
    from transformers.initialization import no_init_weights

    published = getattr(config, "dtype", None)  # what compressed copies are saved in
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # transformers 5.0 does not tie in from_config
    model.source_dtype = getattr(torch, str(published).removeprefix("torch."), dtype) if published else dtype
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            elif param_name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
    return model.eval()
