"""Text generation from a prompt (greedy by default, seeded sampling on request)."""

from __future__ import annotations

import torch
from transformers import TextStreamer


def generate_text(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stream: bool = False,
) -> str:
    """The continuation of ``prompt`` (without the prompt). ``temperature`` 0 is greedy and deterministic."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if temperature < 0:
        raise ValueError("temperature must be >= 0 (0 = greedy)")
    device = next(model.parameters()).device
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, streamer=streamer,
            top_k=None, **sampling,
        )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
