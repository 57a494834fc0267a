"""A slow, obviously-correct reference for every eviction policy.

It never evicts: keys and values stay in transformers' own DynamicCache, and eviction is simulated with
per-(sequence, KV head) Python sets of kept token ordinals, chosen by the policy rules written out in
plain Python. Window and streaming tokens each see their own window (first sinks + last budget-sinks
before them), as if fed one at a time; H2O tokens see the kept set plus their chunk so far. Attention is computed
per head with an explicit mask over the dense keys; rolling positions re-rotate each visible key by (rank in the
kept set - original position) with RoPE written out here.
No padding: batch rows are independent sequences of equal length.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparsegen.kv.policies.knorm import RESOLUTION
from sparsegen.kv.policies.lagkv import FLOOR
from sparsegen.kv.policies.random import MULTIPLIER, SPAN
from sparsegen.models.compat import cache_kwargs

_STATE = {}
ADAPTIVE = ("adakv", "ada-snapkv")  # a layer's heads share their budget


def _layer_wise(policy: dict) -> bool:
    """A rule that chooses once per layer, by the scores summed over its heads (TOVA, as its paper)."""
    return policy["policy"] == "tova" and policy.get("heads", "layer") == "layer"


def keep_rule(policy: dict, candidates: list[int], scores: dict[int, float], seen: int,
              voted: dict[int, float] | None = None) -> set[int]:
    """The tokens a policy keeps out of ``candidates`` (ordinals) after ``seen`` tokens (snapkv-layers: with the
    share of the votes each token last got from the voting layers, ``voted``)."""
    budget = policy["budget"]
    if budget is None or len(candidates) <= budget:
        return set(candidates)
    name = policy["policy"]
    if name == "window":
        return set(sorted(candidates)[-budget:])
    sinks = policy.get("sinks", 0)
    if name == "streaming":
        kept = {t for t in candidates if t < sinks}
        rest = sorted(t for t in candidates if t >= sinks)
        return kept | set(rest[len(rest) - (budget - len(kept)):])
    # h2o / streaming-h2o: protected sinks and recent tokens, then the largest scores (ties: the newer one);
    # tova, knorm, random: the largest scores alone
    protected = {t for t in candidates if t < sinks or t >= seen - policy.get("recent", 0)}
    if name == "lagkv":  # sinks, and partitions whose next one is not seen whole
        protected = {t for t in candidates if t not in scores}
    if name == "snapkv":
        scores = pooled(candidates, scores)
    if name == "snapkv-layers":
        scores = {t: share + (voted or {}).get(t, 0.0) for t, share in shares(candidates, scores).items()}
    others = sorted((t for t in candidates if t not in protected), key=lambda t: (scores[t], t))
    return protected | set(others[len(others) - (budget - len(protected)):])


def pooled(candidates, scores: dict[int, float]) -> dict[int, float]:
    """SnapKV's votes average-pooled over 5 neighbouring held tokens (zeros beyond the ends)."""
    ordered = sorted(candidates)
    votes = [scores.get(t, 0.0) for t in ordered]
    return {t: sum(votes[max(0, j - 2):j + 3]) / 5 for j, t in enumerate(ordered)}


def shares(candidates, scores: dict[int, float]) -> dict[int, float]:
    """Each token's share of its head's pooled SnapKV votes."""
    votes = pooled(candidates, scores)
    total = sum(votes.values())
    return {t: v / total if total > 0 else 0.0 for t, v in votes.items()}


def voting_layers(policy: dict, layers: int) -> range:
    """snapkv-layers' voting layers: its span of the depth, rounded to layers, at least one."""
    low, high = policy["voters"]
    first = min(round(low * (layers - 1)), layers - 1)
    return range(first, max(first, round(high * (layers - 1))) + 1)


def vote_across_layers(state: dict, seen: int) -> None:
    """snapkv-layers at the end of a multi-token call: every layer held the call's tokens whole; the voting layers'
    largest head-averaged share per token is remembered, and each layer keeps by its own share plus that."""
    layers = [i for i, policy in enumerate(state["policy"]) if policy["policy"] == "snapkv-layers"]
    policy = state["policy"][layers[0]]
    for b in range(len(state["voted"])):
        best: dict[int, float] = {}
        for i in voting_layers(policy, len(layers)):
            heads = state["kept"][layers[i]][b]
            mean: dict[int, float] = {}
            for kept, scores in zip(heads, state["scores"][layers[i]][b]):
                for t, share in shares(kept, scores).items():
                    mean[t] = mean.get(t, 0.0) + share / len(heads)
            best = {t: max(best.get(t, 0.0), mean.get(t, 0.0)) for t in set(best) | set(mean)}
        voted = state["voted"][b]
        for layer in layers:
            for kept in state["kept"][layer][b]:
                voted.update({t: best.get(t, 0.0) for t in kept})
        for layer in layers:
            state["kept"][layer][b] = [keep_rule(policy, kept, scores, seen, voted) for kept, scores in
                                       zip(state["kept"][layer][b], state["scores"][layer][b])]


def _rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., n, D]`` by ``delta[n]`` positions (half-split RoPE on the first 2*len(inv_freq) dims)."""
    dim = 2 * inv_freq.numel()
    angle = delta.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(x.dtype)
    rot, rest = x[..., :dim], x[..., dim:]
    half = torch.cat([-rot[..., dim // 2:], rot[..., :dim // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state = _STATE["current"]
    layer = module.layer_idx
    policy, inv_freq = state["policy"][layer], state["inv_freq"][layer]
    batch, q_heads, q, head_dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    scaling = scaling if scaling is not None else head_dim ** -0.5
    start = total - q
    out = torch.zeros(batch, q_heads, q, value.shape[-1], dtype=query.dtype)
    for b in range(batch):
        for h in range(kv_heads):
            kept = state["kept"][layer][b][h]
            scores = state["scores"][layer][b][h]
            if policy["policy"] == "expected-attention":  # the call's tokens, by the queries before the call
                _expected_logits(state, policy, (layer, b, h), group, range(start, total), key[b, h], total, inv_freq)
            for i in range(q):
                t = start + i
                visible = sorted(kept | set(range(start, t + 1)))
                if policy["policy"] in ("window", "streaming"):  # each token sees its own window
                    sinks = policy.get("sinks", 0)
                    recent = policy["budget"] - sinks
                    visible = [j for j in range(t + 1) if j >= t - recent or j < sinks]
                k = key[b, h, visible]
                qh = query[b, h * group:(h + 1) * group, i]
                if state["rolling"]:
                    rank = torch.arange(len(visible))
                    k = _rotate(k, rank - torch.tensor(visible), inv_freq)
                    qh = _rotate(qh[:, None], torch.tensor([len(visible) - 1 - t]), inv_freq)[:, 0]
                if policy["policy"] == "expected-attention" and t >= policy["sinks"]:  # un-rotated, scaled
                    unturned = qh.double() if inv_freq is None else _rotate(qh.double(), torch.full((group,), -t),
                                                                            inv_freq)
                    for g in range(group):
                        state["queries"].setdefault((layer, b, h * group + g), []).append(unturned[g] * scaling)
                probs = torch.softmax((qh.float() @ k.float().T) * scaling, dim=-1)
                if policy["policy"] == "tova":  # the latest query's attention only
                    scores.clear()
                if policy["policy"] == "scissorhands":  # query heads that gave the token more than the average
                    counted = (probs > 1 / len(visible)).float().sum(0)
                else:
                    counted = probs.sum(0)
                votes = "window" not in policy or i >= q - policy["window"]  # SnapKV, ada-snapkv: the last queries
                for tok, p in zip(visible, counted.tolist()):
                    scores[tok] = scores.get(tok, 0.0) + (p if votes else 0.0)
                    if policy.get("history"):  # each query's votes, to count only the latest `history` queries
                        state["votes"].setdefault((layer, b, h, tok), []).append((t, p))
                out[b, h * group:(h + 1) * group, i] = (probs.to(value.dtype) @ value[b, h, visible])
            candidates = sorted(kept | set(range(start, total)))
            if policy["policy"] == "knorm":  # the smallest key norms (a rotation keeps a norm)
                scores.update({t: -round(key[b, h, t].float().norm().item() / RESOLUTION) for t in candidates})
            elif policy["policy"] == "keydiff":  # least like the mean direction of the held keys
                directions = {t: key[b, h, t].float() / key[b, h, t].float().norm() for t in candidates}
                anchor = sum(directions.values())
                anchor = anchor / anchor.norm()
                scores.update({t: -float(directions[t] @ anchor) for t in candidates})
            elif policy["policy"] == "lagkv":  # spread against the next partition's range, shared out
                scores.clear()
                scores.update(_lagkv_scores(policy, candidates, key[b, h], value[b, h], seen=total))
            elif policy["policy"] == "expected-attention":
                if q > 1 and policy["budget"] is not None and len(candidates) > policy["budget"]:  # all anew
                    _expected_logits(state, policy, (layer, b, h), group, candidates, key[b, h], total, inv_freq)
                logits = state["logits"][(layer, b, h)]
                sinks = [t for t in candidates if t < policy["sinks"]]  # kept whatever they score (keep_rule)
                scores.update(_expected_attention_scores([t for t in candidates if t not in sinks], logits,
                                                         value[b, h]))
            elif policy["policy"] == "random":  # a fixed hash of the position
                scores.update({t: float((t * MULTIPLIER) % SPAN) for t in candidates})
            if policy["policy"] in ADAPTIVE or _layer_wise(policy):  # chosen with the layer's other heads, below
                state["kept"][layer][b][h] = set(candidates)
            elif policy["policy"] == "snapkv-layers" and q > 1:  # chosen with every layer, after the call
                state["kept"][layer][b][h] = set(candidates)
                state["deferred"] = total
            else:
                if policy.get("history"):
                    scores = {tok: sum(p for query, p in state["votes"].get((layer, b, h, tok), [])
                                       if query >= total - policy["history"]) for tok in candidates}
                state["kept"][layer][b][h] = keep_rule(policy, candidates, scores, seen=total,
                                                       voted=state["voted"][b])
        if policy["policy"] in ADAPTIVE:
            state["kept"][layer][b] = adaptive_keep_rule(policy, state["kept"][layer][b], state["scores"][layer][b],
                                                         seen=total)
        elif _layer_wise(policy):
            summed = {}
            for scores in state["scores"][layer][b]:
                for tok, p in scores.items():
                    summed[tok] = summed.get(tok, 0.0) + p
            state["kept"][layer][b] = [keep_rule(policy, kept, summed, seen=total) for kept in state["kept"][layer][b]]
    return out.transpose(1, 2).contiguous(), None


def adaptive_keep_rule(policy: dict, candidates: list[set[int]], scores: list[dict], seen: int) -> list[set[int]]:
    """Ada-KV: each head's sinks and recent tokens, its best floor x heavy, then the layer's best of the rest,
    heads x budget in all (ada-snapkv: by each head's pooled SnapKV votes)."""
    budget = policy["budget"] * len(candidates)
    if policy["budget"] is None or sum(map(len, candidates)) <= budget:
        return candidates
    if policy["policy"] == "ada-snapkv":
        scores = [pooled(tokens, votes) for tokens, votes in zip(candidates, scores)]
    sinks, recent = policy["sinks"], policy["recent"]
    guaranteed = math.floor(policy["floor"] * policy["heavy"])
    kept, rest = [], []
    for h, tokens in enumerate(candidates):
        protected = {t for t in tokens if t < sinks or t >= seen - recent}
        others = sorted((scores[h][t] for t in tokens if t not in protected), reverse=True)
        cut = others[guaranteed - 1] if guaranteed and len(others) >= guaranteed else -math.inf
        if guaranteed:
            protected |= {t for t in tokens if t not in protected and scores[h][t] >= cut}
        kept.append(protected)
        rest += [(scores[h][t], t, h) for t in tokens if t not in protected]
    room = budget - sum(map(len, kept))
    for _, t, h in sorted(rest, key=lambda r: (r[0], r[1]))[len(rest) - room:] if room > 0 else []:
        kept[h].add(t)
    return kept


def _lagkv_scores(policy: dict, candidates: list[int], keys, values, seen: int) -> dict[int, float]:
    """LagKV written out: partitions of ``lag`` after the sinks; once the next partition has been seen whole, each
    token's spread against that whole next partition's range, exponentiated against its partition's largest, then
    shared out over the partition's held tokens (the dense keys here hold every token, evicted or not)."""
    sinks, lag = policy["sinks"], policy["lag"]
    groups: dict[int, list[int]] = {}
    for t in candidates:
        if t >= sinks:
            groups.setdefault((t - sinks) // lag, []).append(t)
    scores: dict[int, float] = {}
    for n, members in groups.items():
        if (n + 2) * lag + sinks > seen:
            continue
        start = sinks + n * lag
        own, reference = range(start, start + lag), range(start + lag, start + 2 * lag)
        for x in (keys.double(), values.double()):
            low = torch.stack([x[t] for t in reference]).amin(0)
            high = torch.stack([x[t] for t in reference]).amax(0)
            spread = {t: float(((x[t] - low) / (high - low).clamp(min=FLOOR)).std()) for t in own}
            peak = max(spread.values())
            weights = {t: math.exp(spread[t] - peak) for t in members}
            total = sum(weights.values())
            for t in members:
                scores[t] = scores.get(t, 0.0) + weights[t] / total
    return scores


def _expected_logits(state: dict, policy: dict, where: tuple, group: int, tokens, keys, seen: int, inv_freq) -> None:
    """Expected Attention's logits of ``tokens`` written out, kept per token in ``state["logits"][where]``: for each
    query head of the KV head, the mean and covariance of the queries it saw, each future query ``R_p q`` for p in the
    next ``future`` positions replaced by the mean rotation ``R`` (a matrix, averaged here position by position),
    ``R mu . k + k^T R S R^T k / 2``."""
    layer, b, h = where
    dim = keys.shape[-1]
    turn = torch.eye(dim, dtype=torch.float64)
    if inv_freq is not None:  # _rotate turns rows: each row i of I becomes (R_p e_i)^T, so the rows give R_p^T
        turn = sum(_rotate(torch.eye(dim, dtype=torch.float64), torch.full((dim,), p), inv_freq).T
                   for p in range(seen, seen + policy["future"])) / policy["future"]
    kept = state["logits"].setdefault(where, {})
    for g in range(group):
        seen_by_head = state["queries"].get((layer, b, h * group + g), [])
        stacked = torch.stack(seen_by_head) if seen_by_head else torch.zeros(0, dim, dtype=torch.float64)
        mean = stacked.mean(0) if seen_by_head else torch.zeros(dim, dtype=torch.float64)
        spread = (stacked - mean).T @ (stacked - mean) / max(len(seen_by_head), 1)
        mean, spread = turn @ mean, turn @ spread @ turn.T
        for t in tokens:
            k = keys[t].double()
            logit = float(k @ mean) + (float(k @ spread @ k) / 2 if policy["covariance"] else 0.0)
            kept.setdefault(t, [0.0] * group)[g] = logit


def _expected_attention_scores(candidates: list[int], logits: dict[int, list[float]], values) -> dict[int, float]:
    """Expected Attention's scores, as kvpress's: per query head a softmax of the kept logits over the candidates (the
    sinks left out), averaged over the KV head's query heads, times ``|v|``."""
    if not candidates:
        return {}
    table = torch.tensor([logits[t] for t in candidates])  # [candidates, group]
    expected = torch.softmax(table, 0).mean(1)
    return {t: float(p) * float(values[t].double().norm()) for t, p in zip(candidates, expected)}


AttentionInterface.register("reference_masked", _reference_attention)
AttentionMaskInterface.register("reference_masked", sdpa_mask)


class ReferenceRun:
    """Feed chunks through ``model`` with the reference eviction; returns logits like the model would."""

    def __init__(self, model, policy: dict | list[dict], rolling: bool, batch: int):
        """``policy``: one rule for every layer, or one per layer (policies that size layers differently)."""
        self.model = model
        config = model.config.get_text_config()
        layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        rotary = getattr(model.get_decoder(), "rotary_emb", None)
        # a sliding-window layer of a model that mixes them with global ones keeps its window (sliding_window - 1
        # tokens before the query) whatever the policy, and has its own RoPE frequencies
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        window = {"policy": "window", "budget": (getattr(config, "sliding_window", None) or 0) - 1}
        mixed = "sliding_attention" in types and "full_attention" in types
        self.state = {
            "policy": list(policy) if isinstance(policy, list) else
                      [window if mixed and kind == "sliding_attention" else policy for kind in types],
            "rolling": rolling,
            "inv_freq": [None if rotary is None else getattr(rotary, f"{kind}_inv_freq", None)
                         if hasattr(rotary, f"{kind}_inv_freq") else rotary.inv_freq for kind in types],
            "kept": [[[set() for _ in range(kv_heads)] for _ in range(batch)] for _ in range(layers)],
            "scores": [[[{} for _ in range(kv_heads)] for _ in range(batch)] for _ in range(layers)],
            "votes": {},
            "queries": {},  # expected-attention: each (layer, row, query head)'s queries seen, un-rotated and scaled
            "logits": {},  # expected-attention: each (layer, row, KV head)'s tokens' logits, as they last got them
            "voted": [{} for _ in range(batch)],  # snapkv-layers: the voting layers' share each token last got
            "deferred": None,  # snapkv-layers: the tokens seen by a call whose evictions wait for its end
        }
        self.cache = DynamicCache()  # every layer holds everything: eviction is simulated by the kept sets

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("reference_masked")
        _STATE["current"] = self.state
        try:
            logits = self.model(input_ids=input_ids, **cache_kwargs(self.cache)).logits
            if self.state["deferred"] is not None:
                vote_across_layers(self.state, self.state["deferred"])
                self.state["deferred"] = None
            return logits
        finally:
            self.model.set_attn_implementation(previous)

    def feed(self, input_ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        """Logits of ``input_ids`` fed in calls of the given lengths."""
        logits, start = [], 0
        for n in chunks:
            logits.append(self(input_ids[:, start:start + n]))
            start += n
        return torch.cat(logits, dim=1)

    def kept(self, layer: int, b: int, h: int) -> set[int]:
        return self.state["kept"][layer][b][h]
