"""Compressed contexts: a document prefilled once and compressed to a policy's budget, then reused for many questions
(kvpress's protocol, and what its users ask for: compress once, ask many times) and saved to disk.

A ``CompressedContext`` is a snapshot of an ``EvictionCache`` after the context: every layer's held slots (keys and
values, quantized or not; positions, scores, the policy's memo) and counts. ``cache(model)`` rebuilds a live cache
from it for one question, so questions never see each other. ``save`` writes one ``safetensors`` file whose metadata
records the model's fingerprint and the policy; ``load`` refuses a model other than the one that compressed it,
since its keys and values mean nothing to another model.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.layer import BUFFERS, ROW_STATE
from sparsegen.kv.policies import policy_class
from sparsegen.kv.policy import Policy, policy_options
from sparsegen.kv.quantized import AS_COMPUTED, KVQuantization
from sparsegen.models.anatomy import model_fingerprint, pinned_tokens

FORMAT = "sparsegen.compressed_context/2"  # 2: rolling order-policy keys held turned to their token ordinal
def _damaged(path: Path, problem: str) -> ValueError:
    return ValueError(f"{str(path)!r} is a damaged compressed context: {problem}; write it again with `sparsegen "
                      "compress`")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, dtype, shape and bytes (what ``save`` wrote; ``load`` refuses any other)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# each metadata key a saved context needs, and the types its value may take
META_TYPES = {"model": (str,), "fingerprint": (str,), "policy": (dict,), "positions": (str, type(None)),
              "chunk_size": (int,), "kv_quantization": (dict, type(None)), "length": (int,), "padded": (bool, int),
              "layers": (list,), "text": (str,)}


def _check_meta(path: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The metadata's keys and types, and what can be checked of the tensors without the model."""
    for key, types in META_TYPES.items():
        if key not in meta:
            raise _damaged(path, f"its metadata has no {key!r}")
        if not isinstance(meta[key], types) or (isinstance(meta[key], bool) and bool not in types):
            raise _damaged(path, f"its metadata's {key!r} is {type(meta[key]).__name__}, not "
                                 f"{' or '.join(t.__name__ for t in types)}")
    quant = meta["kv_quantization"]
    if quant is not None and not all(isinstance(quant.get(k), int) for k in ("kv_bits", "kv_residual")):
        raise _damaged(path, "its metadata's 'kv_quantization' lacks integer kv_bits and kv_residual")
    counts = ("used", "fan", "peak_tokens")
    if not meta["layers"] or not all(isinstance(layer, dict) and all(isinstance(layer.get(k), int)
                                                                     and not isinstance(layer.get(k), bool)
                                                                     and layer[k] >= (k == "fan") for k in counts)
                                     for layer in meta["layers"]):
        raise _damaged(path, "its metadata's 'layers' are not each {used, fan, peak_tokens} counts")
    if not all(isinstance(layer.get("budget"), (int, type(None))) and not isinstance(layer.get("budget"), bool)
               and (layer.get("budget") or 1) >= 1 for layer in meta["layers"]):
        raise _damaged(path, "its metadata's layer budgets are not positive token counts")
    if meta["chunk_size"] < 1 or meta["padded"] < 0:
        raise _damaged(path, "its metadata's chunk_size or padding is out of range")
    for name in ("seen", "context_ids"):
        if name not in tensors or tensors[name].dtype != torch.long:
            raise _damaged(path, f"it has no {name!r} tensor of token counts")
    tokens = tensors["context_ids"].numel()
    if meta["length"] < tokens or tensors["seen"].numel() != 1:
        raise _damaged(path, f"its length {meta['length']} does not fit its {tokens} context tokens")
    try:
        policy_from_description(meta["policy"])
    except (KeyError, TypeError, ValueError) as err:
        raise _damaged(path, f"its policy {meta['policy']} cannot be rebuilt ({err})") from None


def _own_budget(layer, counts: dict) -> None:
    """A layer's budget as saved, where a policy gives each layer its own share of the model's
    (``Policy.budget_across_layers``; files written before layers recorded theirs hold the policy's)."""
    budget = counts.get("budget", layer.policy.budget)
    if budget != layer.policy.budget:
        layer.policy = layer.policy.with_budget(budget)


def policy_from_description(description: dict) -> Policy:
    """The policy ``Policy.describe()`` described, rebuilt by its class from the options that class takes; refuses
    a description it cannot rebuild exactly."""
    cls = policy_class(description.get("policy"))
    options = {k: description[k] for k in policy_options(cls) if description.get(k) is not None}
    policy = cls(description["budget"], **options) if description["budget"] is not None else cls(**options)
    if policy.describe() != description:
        raise ValueError(f"cannot rebuild policy {description} from its options; pass the Policy itself")
    return policy


def saved_kv_bits(meta: dict) -> KVQuantization | int:
    """How a saved context held its K/V (``AS_COMPUTED`` where its metadata records no quantization: the file's
    storage, not the model's default)."""
    quant = meta["kv_quantization"]
    return KVQuantization(quant["kv_bits"], quant["kv_residual"]) if quant else AS_COMPUTED


@dataclass
class CompressedContext:
    tensors: dict[str, torch.Tensor]  # "seen", "context_ids" and "layers.{i}.{buffer}" (a layer's held slots)
    meta: dict  # format, model fingerprint and name, policy, positions, kv quantization, counts

    @property
    def tokens(self) -> int:
        """Tokens of context it was compressed from."""
        return int(self.tensors["context_ids"].numel())

    @property
    def held_tokens(self) -> int:
        return max(layer["used"] // layer["fan"] for layer in self.meta["layers"])

    @property
    def held_bytes(self) -> int:
        return sum(t.nbytes for name, t in self.tensors.items() if name.startswith("layers."))

    @classmethod
    def of(cls, model: torch.nn.Module, cache: EvictionCache, context_ids: torch.Tensor,
           text: str = "") -> CompressedContext:
        """Snapshot ``cache``, fed ``context_ids`` (one sequence, evicted to its budget; the tokens of ``text``),
        for ``model``."""
        if cache.seen is None or cache.seen.shape[0] != 1 or cache.step is not None:
            raise ValueError("a compressed context is a cache of one sequence, fed and between calls")
        tensors = {"seen": cache.seen.clone(), "context_ids": context_ids.reshape(-1).cpu().clone()}
        layers = []
        for i, layer in enumerate(cache.layers):
            for name, buf in layer.buffers() + layer.row_state():
                held = buf[:, :, :layer.used] if name in BUFFERS else buf  # slots past `used` hold nothing
                tensors[f"layers.{i}.{name}"] = held.contiguous().clone()
            layers.append({"used": layer.used, "fan": layer.fan, "peak_tokens": layer.peak_tokens,
                           "budget": layer.policy.budget})  # (a layer's own share: ``budget_across_layers``)
        quant = cache.quantization
        meta = {"format": FORMAT, "model": getattr(model.config, "_name_or_path", "") or "",
                "fingerprint": model_fingerprint(model), "policy": cache.policy.describe(),
                "positions": cache.positions, "chunk_size": cache.chunk_size,
                "kv_quantization": quant.describe() if quant else None,
                "length": cache.length, "padded": cache.padded, "layers": layers, "text": text}
        return cls(tensors, meta)

    def check(self, model: torch.nn.Module) -> None:
        if model_fingerprint(model) != self.meta["fingerprint"]:
            raise ValueError(f"this context was compressed by another model ({self.meta['model'] or 'unnamed'}, "
                             f"fingerprint {self.meta['fingerprint']}): compress it again with this one")

    @property
    def text(self) -> str:
        """The context's text (what a server's requests under it continue)."""
        return self.meta.get("text", "")

    def cache(self, model: torch.nn.Module, policy: Policy | None = None, check: bool = True,
              **options) -> EvictionCache:
        """A live cache holding the compressed context, for one question (decoding changes it; the context does
        not). ``policy``: the policy object to run on (its ``describe()`` must match the saved one), for policies
        whose options the description cannot rebuild. ``check=False``: ``model`` was already checked (``check``).
        ``options``: more of ``EvictionCache``'s (``max_length``)."""
        if check:
            self.check(model)
        meta = self.meta
        if policy is None:
            policy = policy_from_description(meta["policy"])
        elif policy.describe() != meta["policy"]:
            raise ValueError(f"the context was compressed under {meta['policy']}, not {policy.describe()}")
        cache = EvictionCache(model, policy, positions=meta["positions"], chunk_size=meta["chunk_size"],
                              kv_bits=saved_kv_bits(meta), **options)
        if len(cache.layers) != len(meta["layers"]):
            raise ValueError("the saved context's layers do not match the model's")
        device = next(model.parameters()).device
        for i, (layer, counts) in enumerate(zip(cache.layers, meta["layers"])):
            for name in BUFFERS + ROW_STATE:
                saved = self.tensors.get(f"layers.{i}.{name}")
                setattr(layer, name, None if saved is None else saved.to(device, copy=True))
            # (the peak starts at what it holds: the compression's own peak, the whole context, is not this cache's)
            layer.used, layer.fan = counts["used"], counts["fan"]
            layer.peak_tokens = layer.used
            _own_budget(layer, counts)
            if layer.keys is not None:
                layer.device, layer.is_initialized = device, True
                # (what attention computes in)
                layer.dtype = layer.keys.dtype if cache.quantization is None else model.dtype
        cache.seen = self.tensors["seen"].to(device, copy=True)
        cache.length, cache.padded = meta["length"], meta["padded"]
        return cache

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"save a compressed context as NAME.safetensors, got {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{uuid.uuid4().hex[:8]}.partial")  # (writers of one name never share a file)
        tensors = {k: v.cpu().contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(partial), metadata={"sparsegen": json.dumps({**self.meta, "digest": _digest(tensors)})})
        partial.replace(path)  # a crash mid-write never leaves a truncated context under the name
        return path

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> CompressedContext:
        """Read a saved context and check it whole: its metadata's keys and types, its tensors' bytes against the
        digest it was saved with, and, with ``model``, that this model compressed it and that every tensor has the
        name, shape, dtype and finite values the model and the policy give it. A damaged file raises one
        ``ValueError`` naming the file and the fix."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no compressed context at {str(path)!r}: write one with `sparsegen compress`")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("sparsegen")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            meta = json.loads(raw) if raw else {}
        except Exception as err:  # noqa: BLE001  (safetensors' own error type is not public)
            raise _damaged(path, f"it cannot be read as safetensors: {' '.join(str(err).split())}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            if isinstance(meta, dict) and str(meta.get("format", "")).startswith(FORMAT.split("/")[0]):
                raise ValueError(f"{str(path)!r} was written by another sparsegen version ({meta['format']}; "
                                 f"this one reads {FORMAT}): compress the context again")
            raise ValueError(f"{str(path)!r} is not a sparsegen compressed context ({FORMAT})")
        digest = meta.pop("digest", None)  # (files written before the digest have none)
        _check_meta(path, meta, tensors)
        if digest is not None and digest != _digest(tensors):
            raise _damaged(path, "its tensors' bytes differ from those it was saved with")
        context = cls(tensors, meta)
        if model is not None:
            context.check(model)
            context._check_tensors(path, model)
        return context

    def check_served(self, name: str, model: torch.nn.Module, cache: EvictionCache) -> None:
        """Refuse to serve this context from a model that did not compress it, or beside sessions whose caches
        (``cache``: an empty one of the server's) hold another policy: a server's sessions decode batched, under one
        policy."""
        self.check(model)
        ours = {**cache.policy.describe(), **(cache.quantization.describe() if cache.quantization else {}),
                "positions": cache.positions}
        theirs = {**self.meta["policy"], **(self.meta["kv_quantization"] or {}), "positions": self.meta["positions"]}
        if ours != theirs:
            raise ValueError(f"context {name!r} was compressed under {theirs}, this server runs {ours}: serve with "
                             "the context's --policy/--budget/--kv-bits, or compress it under the server's")

    def _check_tensors(self, path: Path, model: torch.nn.Module) -> None:
        """Every tensor as a cache of this model under the saved policy holds it: the names, dtypes and shapes of a
        probe cache fed one token (slot counts as the metadata says), finite values, token ordinals in the context."""
        from sparsegen.engine.step import forward

        meta, tensors = self.meta, self.tensors
        probe = EvictionCache(model, policy_from_description(meta["policy"]), positions=meta["positions"],
                              chunk_size=meta["chunk_size"], kv_bits=saved_kv_bits(meta))
        if len(probe.layers) != len(meta["layers"]):
            raise _damaged(path, f"it has {len(meta['layers'])} layers, the model {len(probe.layers)}")
        device = next(model.parameters()).device
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.inference_mode():
            forward(model, probe, token, token, last=True)
        expected = {"seen": ((1,), torch.long), "context_ids": ((self.tokens,), torch.long)}
        for i, (layer, counts) in enumerate(zip(probe.layers, meta["layers"])):
            if counts.get("budget", layer.policy.budget) != layer.policy.budget \
                    and not layer.policy.budget_across_layers:
                raise _damaged(path, f"layer {i}'s budget {counts['budget']} is not its policy's "
                                     f"({layer.policy.budget}), which gives every layer the same")
            _own_budget(layer, counts)
            if counts["fan"] != layer.fan or counts["used"] > layer.most_slots(meta["chunk_size"]):
                raise _damaged(path, f"layer {i}'s counts {counts} do not fit the model under its policy")
            for name, buf in layer.buffers() + layer.row_state():
                shape = list(buf.shape)
                if name in BUFFERS:
                    shape[2] = counts["used"]
                expected[f"layers.{i}.{name}"] = (tuple(shape), buf.dtype)
        if set(tensors) != set(expected):
            odd = sorted(set(tensors) ^ set(expected))
            shown = ", ".join(odd[:4]) + (", ..." if len(odd) > 4 else "")
            raise _damaged(path, f"its tensors are not those of this model's cache under its policy ({shown} missing "
                                 "or unexpected)")
        for name, (shape, dtype) in expected.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise _damaged(path, f"{name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, the "
                                     f"model's cache holds {str(dtype).removeprefix('torch.')} {list(shape)}")
            if tensor.is_floating_point() and not name.endswith(".memo") and not bool(torch.isfinite(tensor).all()):
                raise _damaged(path, f"{name} holds NaN or infinite values")
        # (a prompt prefix the model puts before every sequence; a session's snapshot, ``engine.store``, holds no ids:
        # its length is what its cache saw over its turns)
        seen = self.tokens + pinned_tokens(model) if self.tokens else meta["length"]
        if int(tensors["seen"][0]) != seen or meta["length"] != seen:
            raise _damaged(path, f"its length {meta['length']} is not the {seen} tokens it saw")
        for i in range(len(meta["layers"])):
            index, valid = tensors[f"layers.{i}.index"], tensors[f"layers.{i}.valid"]
            if bool(((index < 0) | (index >= meta["length"]))[valid].any()):
                raise _damaged(path, f"layer {i} holds tokens outside the context's {meta['length']}")

    def describe(self) -> dict:
        return {"model": self.meta["model"], **self.meta["policy"], **(self.meta["kv_quantization"] or {}),
                "positions": self.meta["positions"], "context_tokens": self.tokens, "kv_tokens": self.held_tokens,
                "kv_bytes": self.held_bytes}
