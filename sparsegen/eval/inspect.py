"""What each policy keeps of a prompt: ``sparsegen.inspect`` and the page that draws it (``sparsegen inspect --html``,
``/inspect`` on ``sparsegen serve``).

Every policy reads the same prompt through its own cache, exactly as ``generate`` would (chunked, evicting as it
goes, or kvpress's context protocol); the kept sets are read off the cache's own slots afterwards, per layer and KV
head, with the policy's own priority of each kept token. The attention-sink share per layer comes from the cache's
accumulated attention under a budget that keeps everything (what H2O scores by), so it costs no attention matrix.
With a question, each policy also answers it, and an ``answer`` string marks the prompt tokens that answer needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

from sparsegen.engine.prefill import prefill
from sparsegen.engine.sampling import next_token
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, PolicySpec, make_policy
from sparsegen.kv.cache import DEFAULT_CHUNK
from sparsegen.kv.policies import POLICIES

SINKS = 4  # tokens whose attention share is the sink mass
PAGE = "inspect.html"


def kept_tokens(layer, heads: int) -> list[list[int]]:
    """Token ordinals each KV head of a one-sequence cache's ``layer`` holds, ascending."""
    used = layer.used
    index, valid = layer.index[0, :, :used], layer.valid[0, :, :used]
    if layer.head is not None:  # one pool of slots shared by the heads: each slot says whose it is
        owner = layer.head[0, 0, :used]
        return [sorted(index[0][valid[0] & (owner == h)].tolist()) for h in range(heads)]
    return [sorted(index[h][valid[h]].tolist()) for h in range(heads)]


def _scores(cache: EvictionCache, layer, length: int) -> tuple[list[float | None], list[bool]]:
    """The policy's priority of each token, averaged over the heads holding it (None: held by none, or by its rule
    alone), and whether the policy's rule keeps it whatever it scores (an infinite priority: sinks, recent)."""
    if not layer.is_initialized or layer.used == 0 or layer.policy.budget is None:  # (full scores nothing)
        return [None] * length, [False] * length
    priority = layer.policy.priority(layer.view(cache.seen))[0].double()  # [rows, slots]
    index, valid = layer.index[0, :, :layer.used], layer.valid[0, :, :layer.used]
    finite = valid & torch.isfinite(priority)
    total = torch.zeros(length, dtype=torch.float64).index_add_(0, index[finite], priority[finite])
    count = torch.zeros(length, dtype=torch.float64).index_add_(0, index[finite], torch.ones_like(priority[finite]))
    rule = torch.zeros(length, dtype=torch.bool)
    rule[index[valid & torch.isinf(priority)]] = True
    return [round(t / c, 6) if c else None for t, c in zip(total.tolist(), count.tolist())], rule.tolist()


@torch.inference_mode()
def sink_mass(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK, sinks: int = SINKS,
              after_chunk: Callable[[], None] | None = None) -> list:
    """Per layer, the share of all attention (every query, every head) that went to the first ``sinks`` tokens,
    from an attention-scoring cache that keeps every token (None for a sliding-window layer, which keeps its window
    whatever the policy and scores nothing)."""
    length = ids.shape[1]
    cache = EvictionCache(model, make_policy("h2o", length + 1), chunk_size=chunk_size)
    prefill(model, cache, ids, torch.ones_like(ids), chunk_size, progress=False, after_chunk=after_chunk)
    shares = []
    for layer in cache.layers:
        if layer.attention is None:
            shares.append(None)
            continue
        attention = layer.observed(layer.used)[0].double()  # [heads, slots]
        index = layer.index[0, :, :layer.used]
        total = attention.sum()
        shares.append(round(float(attention[index < sinks].sum() / total), 4) if total > 0 else None)
    return shares


def answer_tokens(offsets: list[tuple[int, int]], text: str, answer: str | None) -> list[int]:
    """Tokens of the prompt that overlap an occurrence of ``answer`` in ``text`` (empty if absent)."""
    if not answer:
        return []
    spans, start = [], text.find(answer)
    while start >= 0:
        spans.append((start, start + len(answer)))
        start = text.find(answer, start + 1)
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(a < end and b > begin for begin, end in spans)]


def _offsets(tokenizer, text: str, ids: list[int]) -> tuple[list[str], list[tuple[int, int]]]:
    """Each token's text and its character span in ``text`` (a special token has an empty span)."""
    pieces, offsets, position = [], [], 0
    for token in ids:
        piece = tokenizer.decode([token])
        special = token in tokenizer.all_special_ids
        found = -1 if special else text.find(piece, position)
        if found < 0 and not special and piece.strip():  # a piece that decodes differently alone (bytes of a char)
            found = text.find(piece.strip(), position)
        if found < 0:
            offsets.append((position, position))
        else:
            offsets.append((found, found + len(piece)))
            position = found + len(piece)
        pieces.append(piece)
    return pieces, offsets


@torch.inference_mode()
def inspect(model: torch.nn.Module, tokenizer, text: str, policies: list[str] | str = ("window", "streaming", "h2o"),
            budget: int | float | str = 256, question: str | None = None, answer: str | None = None,
            protocol: str = "stream", kv_bits: int | None = None, chunk_size: int = DEFAULT_CHUNK,
            max_new_tokens: int = 16, model_name: str = "", after_chunk: Callable[[], None] | None = None) -> dict:
    """What each of ``policies`` keeps of ``text`` (+ ``question``) at ``budget`` (tokens, or a share of the prompt):
    ``{"tokens": [...], "offsets": [...], "answer_tokens": [...], "sink_mass": [per layer], "policies": {name:
    {"kept": [layer][head] -> token ordinals, "count": per token, "layers": per token, "score": per token,
    "protected": per token, "kv_tokens", "reply", "answer_kept"}}}``. The page draws exactly this. ``after_chunk``:
    called after every chunk and reply token the model runs (a server's raises there when its client has left)."""
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    names = [p.strip() for p in policies.split(",")] if isinstance(policies, str) else list(policies)
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    if protocol not in ("stream", "context"):
        raise ValueError(f"protocol is stream or context, got {protocol!r}")
    if protocol == "context" and not question:
        raise ValueError("the context protocol compresses the text before a question: give a question")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    device = next(model.parameters()).device
    prompt = text + (question or "")
    text_ids = tokenizer(text)["input_ids"]
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"] if question else []
    all_ids = text_ids + question_ids
    ids = torch.tensor([all_ids], device=device)
    pieces, offsets = _offsets(tokenizer, prompt, all_ids)
    needed = answer_tokens(offsets[:len(text_ids)], text, answer)
    length = len(all_ids)
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    result = {"model": model_name, "budget": budget, "protocol": protocol, "kv_bits": kv_bits, "question": question,
              "answer": answer, "tokens": pieces, "offsets": offsets, "prompt_tokens": length,
              "question_start": len(text_ids), "answer_tokens": needed, "layers": config.num_hidden_layers,
              "heads": heads, "sinks": SINKS, "policies": {},
              "sink_mass": sink_mass(model, ids, chunk_size, after_chunk=after_chunk)}
    for name in names:
        cache = PolicySpec.sharing(name, budget, kv_bits=kv_bits).cache(
            model, len(text_ids) if protocol == "context" else length, chunk_size=chunk_size)
        policy = cache.policy
        first = len(text_ids) if protocol == "context" else None
        logits = prefill(model, cache, ids, torch.ones_like(ids), chunk_size, progress=False, first_chunk=first,
                         after_chunk=after_chunk)
        kept = [kept_tokens(layer, heads) for layer in cache.layers]
        count = [0] * length
        layers_of = [[] for _ in range(length)]
        for layer_index, per_head in enumerate(kept):
            for held in per_head:
                for token in held:
                    count[token] += 1
            for token in sorted(set().union(*map(set, per_head))):
                layers_of[token].append(layer_index)
        scored = [_scores(cache, layer, length) for layer in cache.layers]
        score = [_mean([s[t] for s, _ in scored if s[t] is not None]) for t in range(length)]
        protected = [any(rule[t] for _, rule in scored) for t in range(length)]
        held = max(cache.held_tokens())
        reply = ""
        if question and max_new_tokens:
            reply = _answer(model, tokenizer, cache, logits, length, max_new_tokens, after_chunk)
        result["policies"][name] = {
            **policy.describe(), "kept": kept, "count": count, "layers_kept": layers_of, "score": score,
            "protected": protected, "kv_tokens": held, "reply": reply,
            "answer_kept": _share([count[t] for t in needed], len(kept) * heads),
        }
    return result


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _share(counts: list[int], pairs: int) -> float | None:
    """How much of the answer's tokens the cache still holds: the mean share of (layer, head) pairs keeping each."""
    return round(sum(counts) / (len(counts) * pairs), 4) if counts else None


def _answer(model, tokenizer, cache: EvictionCache, logits: torch.Tensor, length: int, max_new_tokens: int,
            after_token: Callable[[], None] | None = None) -> str:
    """Greedy reply from the cache as the prompt left it (the kept sets are read before, so the reply's own
    evictions do not show)."""
    step, tokens = DecodeStep(model, compile=False), []
    position = torch.tensor([length], device=logits.device)
    for _ in range(max_new_tokens):
        token = next_token(logits, 0.0, 1.0, None)
        if token.item() == tokenizer.eos_token_id:
            break
        tokens.append(token.item())
        logits = step(cache, token, position)
        position = position + 1
        if after_token is not None:
            after_token()
    return tokenizer.decode(tokens, skip_special_tokens=True)


def page(data: dict | None = None, api: bool = False) -> str:
    """The inspector page: self-contained (no network), with ``data`` drawn at once, or with a form that asks the
    server's ``/v1/inspect`` (``api``)."""
    html = resources.files("sparsegen.eval").joinpath(PAGE).read_text(encoding="utf-8")
    payload = "null" if data is None else json.dumps(data, separators=(",", ":"), allow_nan=False)
    payload = payload.replace("</", "<\\/")  # a prompt holding "</script>" must not end the page's script
    return html.replace("/*DATA*/null", payload).replace("/*API*/false", "true" if api else "false")


def write_html(data: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(data), encoding="utf-8")
    return path


def plot_grid(data: dict, path: str | Path) -> Path:
    """A PNG per policy side by side: layer x head rows, token columns, dark where that head keeps the token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(data["policies"])
    rows, length = data["layers"] * data["heads"], data["prompt_tokens"]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        grid = np.zeros((rows, length))
        for layer, per_head in enumerate(data["policies"][name]["kept"]):
            for head, held in enumerate(per_head):
                grid[layer * data["heads"] + head, held] = 1
        ax.imshow(grid, aspect="auto", cmap="Greys", interpolation="nearest")
        ax.set_title(f"{name} ({data['policies'][name]['kv_tokens']} kept)")
        ax.set_xlabel("token")
        ax.set_ylabel("layer x KV head")
        for t in data["answer_tokens"]:
            ax.axvline(t, color="tab:red", lw=0.5, alpha=0.6)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
