"""A prompt prefix: k embeddings the model sees before every sequence, learned (a soft prompt) or a fixed text.

``attach(model, prefix)`` makes every consumer of the model — generation, perplexity, streaming, fidelity,
pass-key, bench — run on ``prefix + input`` with no change to its code. A forward pre-hook on the decoder puts the
k embeddings in front of the first call of a sequence (no cache, or an empty one), shifts every position by k,
and widens 2D padding masks; a forward hook drops the k positions from the outputs, so logits line up with the
input ids as before. Calls that continue a cache only get their positions shifted: the prefix is in the cache.

An ``EvictionCache`` pins the prefix: its k tokens are never evicted under any policy, like attention sinks
(they are the first tokens of every sequence) — the "learnable sink" idea.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import torch
from torch import nn

from sparsegen.models.anatomy import PINNED
from sparsegen.models.compat import passed_cache

FORMAT = "sparsegen-prompt"
_STATE = threading.local()  # per-thread stack: whether each running decoder forward put the prefix in front


class PromptPrefix(nn.Module):
    """``embeddings`` ``[k, hidden]``; ``info`` says where they came from (text, or training settings and losses)."""

    def __init__(self, embeddings: torch.Tensor, info: dict | None = None):
        super().__init__()
        if embeddings.dim() != 2:
            raise ValueError(f"prompt embeddings must be [tokens, hidden], got shape {tuple(embeddings.shape)}")
        self.embeddings = nn.Parameter(embeddings)
        self.info = dict(info or {})

    @property
    def length(self) -> int:
        return self.embeddings.shape[0]

    @classmethod
    def from_text(cls, model: nn.Module, tokenizer, text: str) -> PromptPrefix:
        """A hard prompt: the embeddings of ``text``'s tokens (no special tokens), exactly what feeding them gives."""
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        if len(ids) == 0:
            raise ValueError("the hard prompt text is empty")
        return cls.from_ids(model, ids, {"kind": "text", "text": text, "tokens": len(ids)})

    @classmethod
    def from_ids(cls, model: nn.Module, ids: torch.Tensor, info: dict) -> PromptPrefix:
        """The embeddings the model gives ``ids`` (its embedding layer's own forward: Gemma scales its table)."""
        embed = model.get_input_embeddings()
        with torch.no_grad():
            table = next(itertools.chain(embed.parameters(), embed.buffers()))  # (``BlockEmbedding``: its codes)
            return cls(embed(ids.to(table.device)).detach().clone().float(), info)

    @classmethod
    def from_vocabulary(cls, model: nn.Module, tokens: int, seed: int = 0) -> PromptPrefix:
        """A soft prompt to train, started at the embeddings of ``tokens`` random vocabulary entries (Lester et al.)."""
        if tokens < 1:
            raise ValueError(f"a soft prompt needs at least 1 token, got {tokens}")
        vocabulary = model.get_input_embeddings().num_embeddings
        ids = torch.randint(vocabulary, (tokens,), generator=torch.Generator().manual_seed(seed))
        return cls.from_ids(model, ids, {"kind": "soft"})

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        from safetensors.torch import save_file

        from sparsegen.output import new_file

        with new_file(path, overwrite) as work:
            save_file({"embeddings": self.embeddings.detach().float().cpu().contiguous()}, work,
                      metadata={"format": FORMAT, "info": json.dumps(self.info)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> PromptPrefix:
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no soft prompt at {path}; train one with `sparsegen prompt-tune --out {path}`")
        try:
            with safe_open(path, framework="pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != FORMAT or "embeddings" not in f.keys():
                    raise ValueError(f"{path} is a safetensors file but not a sparsegen prompt (written by "
                                     f"`sparsegen prompt-tune`)")
                return cls(f.get_tensor("embeddings"), json.loads(metadata.get("info", "{}")))
        except (SafetensorError, json.JSONDecodeError) as err:
            raise ValueError(f"the prompt file {path} could not be read ({err}); it may be truncated: "
                             f"train or copy it again") from None


def prefix_of(model: nn.Module) -> PromptPrefix | None:
    """The prefix attached to ``model``, if any."""
    return getattr(model.get_decoder(), "_sparsegen_prefix", None)


def _starts_sequence(cache) -> bool:
    return cache is None or cache.get_seq_length() == 0


def _stack() -> list[int]:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack


def _before(decoder: nn.Module, args: tuple, kwargs: dict):
    prefix = decoder._sparsegen_prefix
    _stack().append(0)  # popped by _after, which runs even if this call fails
    kwargs = dict(kwargs)
    if args:  # the decoder's first positional argument is input_ids
        kwargs["input_ids"], args = args[0], args[1:]
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if embeds is None:
        embeds = decoder.get_input_embeddings()(ids)
    kwargs["input_ids"], kwargs["inputs_embeds"] = None, embeds
    batch, length = embeds.shape[:2]
    k, device = prefix.length, embeds.device
    first = _starts_sequence(passed_cache(kwargs))
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError("a prompt prefix needs a 2D padding mask (batch, length); custom 4D masks are not "
                             "supported")
        kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, k), mask], dim=1)
    for key in ("position_ids", "cache_position"):
        if kwargs.get(key) is not None:
            shifted = kwargs[key] + k
            if first:
                own = torch.arange(k, device=device)
                own = own[None].expand(shifted.shape[0], k) if shifted.dim() == 2 else own
                shifted = torch.cat([own, shifted], dim=-1)
            kwargs[key] = shifted
    if first:
        vectors = prefix.embeddings.to(dtype=embeds.dtype, device=device)
        kwargs["inputs_embeds"] = torch.cat([vectors[None].expand(batch, k, -1), embeds], dim=1)
    _stack()[-1] = k if first else 0
    return args, kwargs


def _after(decoder: nn.Module, args: tuple, kwargs: dict, output):
    k = _stack().pop()
    if k and output is not None:
        output.last_hidden_state = output.last_hidden_state[:, k:]
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h[:, k:] for h in output.hidden_states)
    return output


def attach(model: nn.Module, prefix: PromptPrefix) -> nn.Module:
    """Make ``model`` see ``prefix`` before every sequence (in place; ``detach`` undoes it)."""
    decoder = model.get_decoder()
    if getattr(decoder, "_sparsegen_prefix", None) is not None:
        raise ValueError("this model already has a prompt prefix; detach it first")
    hidden = model.get_input_embeddings().embedding_dim
    if prefix.embeddings.shape[1] != hidden:
        raise ValueError(f"the prompt has {prefix.embeddings.shape[1]}-dimensional embeddings but the model's are "
                         f"{hidden}-dimensional: it was trained for another model")
    # kept beside the decoder, not registered in it: the prompt is not part of the model's state_dict or
    # parameters (the hook moves it to the model's device and dtype at each call)
    vars(decoder)["_sparsegen_prefix"] = prefix
    setattr(decoder, PINNED, prefix.length)
    decoder._sparsegen_prefix_hooks = (
        decoder.register_forward_pre_hook(_before, with_kwargs=True, prepend=True),
        decoder.register_forward_hook(_after, with_kwargs=True, prepend=True, always_call=True),
    )
    return model


def detach(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder()
    for handle in getattr(decoder, "_sparsegen_prefix_hooks", ()):
        handle.remove()
    vars(decoder).pop("_sparsegen_prefix", None)
    decoder._sparsegen_prefix_hooks = ()
    setattr(decoder, PINNED, 0)
    return model
