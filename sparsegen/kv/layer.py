"""One layer's held tokens: a preallocated ``[batch, kv_heads, budget + chunk, head_dim]`` buffer of slots.

A forward step appends its tokens after the held ones; attention (``sparsegen.kv.attention``) runs over held + new;
then the layer keeps the ``budget`` highest-priority tokens of every (sequence, KV head) and fills the holes left in
the front by moving the few survivors from the tail. Slot order carries no meaning (attention is order-free), so a
decode step moves at most one token per head. A quantized layer holds codes with their scales
(``sparsegen.kv.quantized``); under a policy whose heads share slots (Ada-KV) a layer has one row of
``budget x kv_heads`` slots tagged by head.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparsegen.kv.policy import Policy, TokenView
from sparsegen.kv.quantized import TINY, HeldCodes, KVQuantization, dequantize, quantize
from sparsegen.kv.rotary import memoized

# per-slot state, all [batch, kv_heads, slots, ...]; keys and values are byte codes when the cache is quantized
BUFFERS = ("keys", "values", "key_scale", "key_zero", "value_scale", "value_zero", "index", "valid", "attention",
           "memo", "head")  # memo: the policy's own numbers (``Policy.memo_width``); head: each slot's KV head,
# where the layer's heads share one pool of slots (``shares_slots``)
KV_BUFFERS = BUFFERS[:6]  # what a slot's K and V cost
# per-row state of a quantized cache: each key channel's scale [B, H, 1, D]; the full-precision residual of the newest
# tokens, at slot (token ordinal % residual) of a ring (one slot more, where other tokens' writes go) [B, H, R + 1, D]
# with the ordinal each ring slot holds [B, R + 1]
# the running moments of the queries a policy that ``needs_queries`` reads [B, Hq, D + 1, D + 1] (``TokenView.queries``)
ROW_STATE = ("key_channels", "ring_keys", "ring_values", "ring_index", "query_moments")


@dataclass
class Step:
    """What the current forward call brings, per sequence: set by the model hook before the layers run."""

    new_valid: torch.Tensor  # bool [batch, q]: real tokens (False = padding)
    new_index: torch.Tensor  # int64 [batch, q]: ordinal of each new token among its sequence's real tokens
    positions: torch.Tensor  # int64 [batch, q]: the positions the model rotates the new tokens with
    seen: torch.Tensor  # int64 [batch]: real tokens seen, this step included
    # what every layer of this step would compute alike, computed once (None inside a regional step's blocks)
    memo: dict | None = field(default_factory=dict)


class EvictionLayer(CacheLayerMixin):
    """One layer's held tokens. A sliding-window layer of a model that mixes them with global layers (Gemma 3,
    Qwen2/3 with ``layer_types``) keeps exactly its window, as the model's own cache does, whatever the cache's
    policy: ``policy`` is then a window of ``sliding_window - 1`` tokens and no prompt prefix is pinned."""

    is_compileable = False

    def __init__(self, cache: Cache, layer_idx: int, policy: Policy, pinned: int, rotary=None,
                 is_sliding: bool = False):
        super().__init__()
        # a weak reference: a strong one makes every cache a reference cycle, which only Python's cyclic collector
        # frees, rarely, so a server's dropped sessions kept their K/V memory for good
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.policy, self.pinned, self.rotary, self.is_sliding = policy, pinned, rotary, is_sliding
        self.used = 0  # slots in use (the largest held count of any sequence, plus the pending chunk)
        self.pending = 0  # tokens appended by update() and not yet attended
        self.stored = 0  # tokens the latest update() stored (``TokenView.new``)
        self.peak_tokens = 0
        self.parked = 0  # slots it had when its cache was parked (kv.rows.park), given back after
        self.storage: dict[str, torch.Tensor] | None = None  # a stacked cache's buffers for all its row capacity
        # codes and scales (8, 4, 2 bits), or None: numbers, in ``cache.kv_dtype`` or as the model computes them
        self.quantization: KVQuantization | None = cache.quantization if cache.kv_dtype is None else None
        self.fan = 1  # KV heads sharing each row of slots (all of them under a ``shares_slots`` policy)
        # rolling positions under an order policy: keys are held turned to their token ordinal, where a recent key
        # already sits at its rolling distance from the query (attention then turns only the query; see
        # ``eviction_attention``); otherwise rolling keys are held unrotated and turned to their rank every step
        view = self.query_view()
        self.keys_at_index = (cache.rolling and rotary is not None and view is not None
                              and self.quantization is None and not policy.shares_slots and rotary.exact)
        self.sinks = view[0] if self.keys_at_index else 0  # (kept when ``stop_evicting`` lifts the budget)
        # whether a row may have held more tokens than the budget (or will, by the length the caller announced): until
        # one has, nothing was evicted and every token's rank is its ordinal, so the rolling positions' sinks need no
        # frame of their own (``_index_frame_queries``); set by the cache's ``mark_evicting``, and it stays set. Only
        # those layers are marked: the mark is part of a compiled step's state, and another graph for other layers
        # when a budget is passed would be a compile for nothing
        self.may_evict = False
        # whether a decode step (over a full budget, or fixed-shape) may leave its new K/V out of the slots until
        # eviction (``incoming``): not where the policy reads held K/V (they must be in the slots) or they are
        # shared between heads
        self.places_incoming = not (policy.needs_keys or policy.needs_values or policy.memo_width
                                    or policy.shares_slots)
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None
        for name in BUFFERS + ROW_STATE:
            setattr(self, name, None)

    @property
    def cache(self) -> Cache:
        """The ``EvictionCache`` that holds this layer."""
        return self._cache()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage for ``[batch, kv_heads, tokens, head_dim]`` states: one row of slots per KV head, or one row
        that all heads share."""
        batch, heads, _, head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.fan = heads if self.policy.shares_slots else 1
        rows = heads // self.fan
        capacity = self.capacity(key_states.shape[-2])
        quant = self.quantization
        if quant is None:
            held = self.cache.kv_dtype or key_states.dtype
            self.keys = key_states.new_zeros(batch, rows, capacity, head_dim, dtype=held)
            self.values = value_states.new_zeros(batch, rows, capacity, value_states.shape[-1], dtype=held)
        else:
            quant.check(head_dim)
            quant.check(value_states.shape[-1])
            codes = {"dtype": torch.uint8, "device": self.device}
            self.keys = torch.zeros(batch, rows, capacity, head_dim * quant.bits // 8, **codes)
            self.values = torch.zeros(batch, rows, capacity, value_states.shape[-1] * quant.bits // 8, **codes)
            for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
                setattr(self, name, torch.zeros(batch, rows, capacity, 1, dtype=torch.float16, device=self.device))
            self.key_channels = key_states.float().abs().amax((2, 1) if self.fan > 1 else 2, keepdim=True)
            self.key_channels.clamp_(min=TINY)
            if quant.residual:
                ring = quant.residual + 1
                self.ring_keys = key_states.new_zeros(batch, heads, ring, head_dim)
                self.ring_values = value_states.new_zeros(batch, heads, ring, value_states.shape[-1])
                self.ring_index = torch.full((batch, ring), -1, dtype=torch.long, device=self.device)
        self.index = torch.zeros(batch, rows, capacity, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(batch, rows, capacity, dtype=torch.bool, device=self.device)
        history = (self.policy.history,) if self.policy.history else ()  # one column per query of the window
        self.attention = (
            torch.zeros(batch, rows, capacity, *history, dtype=torch.float32, device=self.device)
            if self.policy.needs_attention else None
        )
        if self.policy.memo_width:
            width = self.policy.memo_width * (self.cache.query_heads // heads if self.policy.memo_per_query_head else 1)
            self.memo = torch.full((batch, rows, capacity, width), torch.nan, dtype=torch.float64,
                                   device=self.device)
        if self.fan > 1:
            self.head = torch.zeros(batch, 1, capacity, dtype=torch.long, device=self.device)
        if self.policy.needs_queries:  # (per query head: the model's, the number of its attention heads)
            q_heads = self.cache.query_heads
            self.query_moments = torch.zeros(batch, q_heads, head_dim + 1, head_dim + 1, dtype=torch.float32,
                                             device=self.device)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        """More slots: doubling, up to what the policy can ever hold (``most_slots``)."""
        self._reallocate(max(needed, min(2 * self.keys.shape[2], self.most_slots(-(-needed // self.fan)))))

    def _reallocate(self, capacity: int) -> None:
        """Every slot buffer at ``capacity`` slots, the slots in use (all within it) copied."""
        for name, old in self.buffers():
            new = old.new_zeros(*old.shape[:2], capacity, *old.shape[3:])
            kept = min(capacity, old.shape[2])
            new[:, :, :kept] = old[:, :, :kept]
            setattr(self, name, new)

    def buffers(self):
        return [(name, getattr(self, name)) for name in BUFFERS if getattr(self, name) is not None]

    def row_state(self):
        return [(name, getattr(self, name)) for name in ROW_STATE if getattr(self, name) is not None]

    @property
    def bytes_per_slot(self) -> int:
        """K and V bytes of one token slot (codes, scales and zero points when quantized), over the batch and KV
        heads."""
        if not self.is_initialized:
            return 0
        return sum(buf.element_size() * math.prod(buf.shape[:2] + buf.shape[3:])  # (a parked buffer has no slot)
                   for name, buf in self.buffers() if name in KV_BUFFERS)

    @property
    def row_state_bytes(self) -> int:
        """Bytes a quantized layer holds besides its slots: channel scales and the full-precision residual."""
        return sum(buf.nbytes for _, buf in self.row_state())

    def store(self, start: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens into slots ``start:end`` (quantized, when the cache is)."""
        slots = self.slots(start, end)
        for name, x in self.encoded(keys, values).items():
            getattr(self, name)[:, :, slots] = x

    def slots(self, start: int, end: int) -> slice | torch.Tensor:
        """Slots ``start:end`` as a step writes them: a fixed step by their numbers (an index write, which inductor
        does in place: written as a slice, each buffer a step wrote twice, the spare slot and the slot it takes, was
        copied whole, twice)."""
        if self.cache.fixed_step:
            return torch.arange(start, end, device=self.device)
        return slice(start, end)

    def encoded(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """What tokens' K/V put in each K/V buffer: themselves, or their codes, scales and zero points."""
        quant = self.quantization
        if quant is None:  # (in the held dtype: float16 under ``kv_bits=16``)
            return {"keys": keys.to(self.keys.dtype), "values": values.to(self.values.dtype)}
        out = {}
        for prefix, x in (("key", keys.float() / self.key_channels), ("value", values)):
            out[prefix + "s"], out[prefix + "_scale"], out[prefix + "_zero"] = quantize(x, quant.bits)
        return out

    def held(self, end: int, new_keys: torch.Tensor | None = None,
             new_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``:end`` as attention reads them (followed by ``new_keys``/``new_values``, the
        call's own tokens, when given): the stored tensors, or, when quantized, the dequantized codes with the newest
        tokens taken from the full-precision residual. Float16-held K/V (``kv_bits=16``) come as they are held."""
        if self.quantization is None:
            return self.keys[:, :, :end], self.values[:, :, :end]
        bits, residual = self.quantization.bits, self.quantization.residual
        out = []
        for name, new in (("key", new_keys), ("value", new_values)):
            codes = getattr(self, name + "s")
            tokens = end + (0 if new is None else new.shape[2])
            x = torch.empty(*codes.shape[:2], tokens, codes.shape[-1] * 8 // bits, dtype=self.dtype,
                            device=self.device)
            dequantize(codes[:, :, :end], getattr(self, name + "_scale")[:, :, :end],
                       getattr(self, name + "_zero")[:, :, :end], bits, out=x[:, :, :end])
            if new is not None:
                x[:, :, end:] = new
            out.append(x)
        keys, values = out
        keys[:, :, :end] *= self.key_channels
        if residual and end:  # the few slots whose token is in the ring: its full-precision K/V
            self._read_residual(keys, values, end)
        return keys, values

    @property
    def reads_codes(self) -> bool:
        """Whether a decode step's attention reads this quantized layer's codes as they are (``HeldCodes``): on a
        CPU in fp32 (the grouped-matmul path), with keys held rotated (rolling positions turn every held key)."""
        return (self.quantization is not None and not self.cache.rolling and self.device.type == "cpu"
                and self.dtype == torch.float32)

    def held_codes(self, end: int) -> tuple[HeldCodes, HeldCodes]:
        """Keys and values of slots ``:end`` as codes, for attention to read without decoding them; the slots whose
        token is in the full-precision residual are marked, with their ring entry."""
        bits, residual = self.quantization.bits, self.quantization.residual
        fresh, entry = self._ring_entries(end) if residual else (None, None)
        return tuple(HeldCodes(getattr(self, name + "s")[:, :, :end], getattr(self, name + "_scale")[:, :, :end],
                               getattr(self, name + "_zero")[:, :, :end], bits, channels,
                               ring[:, :, :residual] if residual else None, fresh, entry)
                     for name, channels, ring in (("key", self.key_channels, self.ring_keys),
                                                  ("value", None, self.ring_values)))

    def _ring_entries(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For slots ``:end``: whether each slot's token is in the residual's ring, and the ring entry it would be in
        (``[B, rows, end]`` each)."""
        index = self.index[:, :, :end]
        entry = index % self.quantization.residual
        return self.ring_index.gather(1, entry.flatten(1)).view_as(index) == index, entry

    def _read_residual(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        """Put each ring token's full-precision K/V in place of its dequantized slot among ``:end``, in shapes that do
        not depend on the data (no ``nonzero``): the slots whose token is in the ring are zeroed, each ring entry's
        slot is found by comparing indices (``[B, rows, end, entries]``: the residual, or every head's under
        ``shares_slots``) and its K/V added there (an entry whose token is not held adds 0 to slot 0). Writes every
        slot once and the ring's, where a gather of the ring for every slot wrote and read each slot twice more."""
        residual = self.quantization.residual
        batch, rows, _, dim = keys.shape
        index = self.index[:, :, :end]
        fresh = self._ring_entries(end)[0][..., None]
        matches = (index[..., None] == self.ring_index[:, None, None, :residual]) & self.valid[:, :, :end, None]
        if self.fan > 1:  # one shared row: entry (h, r) is head h's token in ring slot r
            heads = torch.arange(self.fan, device=self.device)[:, None]
            matches = (matches[..., None, :] & (self.head[:, :, :end, None, None] == heads)).flatten(-2)
        found = matches.any(2)[..., None]  # [B, rows, entries, 1]
        slots = torch.arange(end, device=self.device)[:, None]
        slot = torch.where(matches, slots, 0).amax(2)[..., None].expand(-1, -1, -1, dim)  # (at most one match)
        for x, ring in ((keys, self.ring_keys), (values, self.ring_values)):
            x[:, :, :end].masked_fill_(fresh, 0)  # (a fresh slot's codes may decode to anything: never added to)
            ring = ring[:, :, :residual].reshape(batch, rows, -1, dim)  # (shared: every head's entries in one row)
            x.scatter_add_(2, slot, torch.where(found, ring, 0))

    def remember(self, step: Step, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put the call's real tokens that are among their row's ``residual`` newest into the ring."""
        residual = self.quantization.residual
        if not residual:
            return
        newest = step.new_valid & (step.new_index >= step.seen[:, None] - residual)
        ring_slot = torch.where(newest, step.new_index % residual, residual)  # the rest all go to the spare slot
        take = ring_slot[:, None, :, None]
        self.ring_keys.scatter_(2, take.expand(-1, keys.shape[1], -1, keys.shape[-1]), keys)
        self.ring_values.scatter_(2, take.expand(-1, values.shape[1], -1, values.shape[-1]), values)
        self.ring_index.scatter_(1, ring_slot, step.new_index)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        step = self.cache.step
        if step is None:
            raise RuntimeError("EvictionCache was used outside a forward of the model it was built for")
        if self.pending:
            raise RuntimeError(
                "the previous step's tokens were never attended through sparsegen's attention: the model's "
                "attn_implementation was changed after the cache was built; build a new EvictionCache"
            )
        if self.keys_at_index:
            key_states = self.rotary.turn(key_states, step.positions, step.new_index[:, None, :], step.memo)
        elif self.cache.rolling:
            key_states = self.rotary.unrotate(key_states, step.positions, step.memo)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.quantization is not None:
            self.remember(step, key_states, value_states)
        new_index, new_valid = step.new_index, step.new_valid
        if self.fan > 1:  # the heads' tokens one after another in the shared row: slot start + h * q + i
            batch, heads, tokens, _ = key_states.shape
            key_states, value_states = (x.reshape(batch, 1, heads * tokens, x.shape[-1])
                                        for x in (key_states, value_states))
            new_index, new_valid = new_index.repeat(1, heads), new_valid.repeat(1, heads)
        q = key_states.shape[-2]
        fixed = self.cache.fixed_step
        start = self.fixed_slots if fixed else self.used  # a fixed step's token waits in the spare slot
        end = start + q
        if end > self.keys.shape[2]:
            self._grow(end)
        # a fixed step, or an unpadded decode step over a full budget, keeps its token's K/V apart until eviction
        # writes them into the slot it takes: one write per buffer a step (a compiled step that wrote the spare slot,
        # then moved it, copied the whole cache every step). (A padded eager step's rows may be
        # under budget: it compacts, which reads the stored token.)
        self.incoming = (key_states, value_states) if q == 1 and self.places_incoming \
            and (fixed or (start == self.slot_budget and not self.cache.padded)) else None
        if self.incoming is None:
            self.store(start, end, key_states, value_states)
        elif self.cache.kv_dtype is not None:  # (attended as it will be held, whichever path attends)
            self.incoming = tuple(x.to(self.cache.kv_dtype).to(x.dtype) for x in self.incoming)
        slots = self.slots(start, end)
        self.index[:, :, slots] = new_index[:, None, :]
        self.valid[:, :, slots] = new_valid[:, None, :]
        if self.head is not None:
            self.head[:, :, slots] = torch.arange(heads, device=self.device).repeat_interleave(tokens)
        if self.attention is not None:
            self.attention[:, :, slots] = 0
        if self.memo is not None:
            self.memo[:, :, slots] = torch.nan
        self.used, self.pending, self.stored = end, q, q
        if not fixed:  # (a fixed step's caller counts: a number read here would be one the graph specialises on)
            self.peak_tokens = max(self.peak_tokens, end)
        if self.incoming is not None:  # attention reads the held slots and ``incoming``
            return self.held_codes(start) if self.reads_codes else self.held(start)
        # the call's own tokens are attended in full precision
        keys, values = self.held(end) if self.quantization is None else self.held(start, key_states, value_states)
        if self.memo is not None:
            self.memorize(step.seen, keys, values)
        return keys, values

    def memorize(self, seen: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Let a policy with a memo write what it can now, from the held keys and values as attention reads them."""
        self.policy.memorize(replace(self.view(seen), keys=keys, values=values))

    def observe_queries(self, query: torch.Tensor, scaling: float, tokens: slice = slice(None)) -> None:
        """Add the call's real queries ``query[B, Hq, q, D]`` (its ``tokens``) past the policy's sinks to each query
        head's moments (``TokenView.queries``): un-rotated, so that a policy can turn them to any position, and scaled
        as attention scales them."""
        step = self.cache.step
        positions, valid, index = step.positions[:, tokens], step.new_valid[:, tokens], step.new_index[:, tokens]
        whole = tokens == slice(None)
        raw = query if self.rotary is None else self.rotary.unrotate(query, positions, step.memo if whole else None)
        counted = valid & (index >= getattr(self.policy, "sinks", 0))  # (attention sinks' queries are outliers)
        x = torch.cat((raw.float() * scaling, raw.new_ones(*raw.shape[:-1], 1, dtype=torch.float32)), -1)
        self.query_moments += (x * counted[:, None, :, None]).transpose(-1, -2) @ x

    def query_view(self) -> tuple[int, int] | None:
        """The policy's ``(sinks, recent)`` with the pinned prefix counted among the sinks."""
        view = self.policy.query_view()
        if view is None or not self.pinned or view[0] >= self.pinned:
            return view
        return self.pinned, self.policy.budget - self.pinned

    def most_slots(self, chunk: int) -> int:
        """Slots a bounded policy can need with calls of ``chunk`` tokens: its budget plus one call (for each head
        sharing a row)."""
        budget, most = self.policy.budget, self.cache.max_length
        if budget is None:
            return sys.maxsize if most is None else max(most, chunk) * self.fan
        return (budget + max(self.cache.chunk_size, chunk)) * self.fan

    def capacity(self, first_chunk: int) -> int:
        """Slots allocated at first: what the sequence is expected to need, at most what the policy can ever hold;
        ``_grow`` doubles it when needed. A short conversation under a large budget so costs what it holds, not its
        budget (a server keeps many); a first call of a whole chunk announces a long sequence, which gets every slot
        it can ever use at once (no growth, no moment with two copies), unless the caller announced its length."""
        most = self.most_slots(first_chunk)
        if first_chunk >= self.cache.chunk_size and self.policy.budget is not None and not self.cache.expected_length:
            return most
        return min(most, max(first_chunk, self.cache.expected_length, 64) * self.fan)

    @property
    def fixed_slots(self) -> int | None:
        """Slots a fixed-shape decode step (``EvictionCache.fixed_step``) attends over, some perhaps free: a bounded
        policy's budget, an unbounded one's allocation less the spare slot where the step's token waits (a bounded
        one's too where the caller announced a sequence shorter than the budget). None where
        no such step runs (no storage yet, heads sharing slots, a policy that reads the host to choose)."""
        if not self.is_initialized or self.fan > 1 or self.policy.reads_host:
            return None
        if self.policy.budget is None or self.cache.length_announced:
            # a sequence announced shorter than the budget is allocated its length, and attends over no more
            return min(self.slot_budget or sys.maxsize, self.keys.shape[2] - 1)
        return self.slot_budget

    @property
    def slot_budget(self) -> int | None:
        """Slots a row keeps: the budget, times the heads sharing the row."""
        return None if self.policy.budget is None else self.policy.budget * self.fan

    def view(self, seen: torch.Tensor) -> TokenView:
        t = self.used
        keys, values = self.held(t) if self.policy.needs_keys or self.policy.needs_values else (None, None)
        return TokenView(
            index=self.index[:, :, :t], valid=self.valid[:, :, :t], seen=seen,
            attention=None if self.attention is None else self.observed(t),
            keys=keys if self.policy.needs_keys else None,
            values=values if self.policy.needs_values else None,
            head=None if self.head is None else self.head[:, :, :t], heads=self.fan,
            memo=None if self.memo is None else self.memo[:, :, :t],
            queries=self.query_moments, rotary=self.rotary if self.policy.needs_queries else None, new=self.stored,
        )

    def observed(self, end: int) -> torch.Tensor:
        """What the policy's attention statistic says of slots ``:end``: summed over the history window, if any."""
        attention = self.attention[:, :, :end]
        return attention.sum(-1) if attention.dim() == 4 else attention

    def evict(self, seen: torch.Tensor, now: bool = False) -> None:
        """Keep the ``budget`` highest-priority real tokens of each (sequence, head); compact them to the front.

        Ties go to the more recent token. A decode step drops at most one token per row, found with two
        reductions; a longer step sorts by (priority, index). A policy that chooses ``across_layers`` has a
        multi-token call's evictions wait for the end of the call (unless ``now``).
        """
        self.pending = 0
        if self.cache.fixed_step:
            self._overwrite(self.free_or_lowest_slot(seen), newest=self.fixed_slots)
            return
        budget = self.slot_budget
        if budget is None:
            return
        if self.policy.across_layers and not now and self.cache.step.new_valid.shape[1] > 1:
            self.cache.deferred.append(self)
            return
        decode = self.cache.step.new_valid.shape[1] == 1 and self.fan == 1  # at most one token over per row
        if decode and not self.cache.padded and self.used <= budget + 1:
            # every row holds exactly ``used`` tokens in slots 0..used-1, the newest last: over the budget all
            # together, or none; the newest token moves into the slot its row evicts
            if self.used > budget:
                self._overwrite(self.lowest_slot(self.view(seen)), newest=budget)
            return
        valid = self.valid[:, :, :self.used]
        held = valid.sum(-1)  # [batch, rows]
        keep_count, over = held.clamp(max=budget), held > budget
        if decode and self.used <= budget + 1:
            # rows hold their tokens contiguously from slot 0 and the longest holds ``used`` (the new token
            # included), so what compaction needs is known here without reading the device: at most one hole per
            # row (the token evicted, or a shorter row's gap before its new token) and ``min(used, budget)`` after
            self._compact(self.drop_lowest(self.view(seen), over[..., None]), keep_count, moves=1,
                          used=min(self.used, budget))
            return
        if not bool(over.any()):
            kept = valid  # no row over its budget: no policy is asked (only padding leaves)
        elif decode:
            kept = self.drop_lowest(self.view(seen), over[..., None])
        else:
            kept = self.keep_highest(self.view(seen), keep_count)
        self._compact(kept, keep_count)

    def compress(self, seen: torch.Tensor, keep_count: torch.Tensor | None = None) -> None:
        """Keep the budget's highest-priority tokens now, between calls (a context scored by a pass of its own:
        ``Policy.reconstructs``), or each row's ``keep_count`` (``[batch, rows]``) of them, and give back the room
        the pass took."""
        if self.is_initialized and self.slot_budget is not None:
            held = self.valid[:, :, :self.used].sum(-1)
            keep_count = held.clamp(max=self.slot_budget) if keep_count is None else keep_count.clamp(max=held)
            self._compact(self.keep_highest(self.view(seen), keep_count), keep_count)
            if self.policy.shares_slots and self.fan == 1 and self.valid.shape[1] > 1:
                self._pool_heads()
            room = self.slot_budget + self.cache.chunk_size * self.fan
            if self.keys.shape[2] > room:
                self._reallocate(room)

    def _pool_heads(self) -> None:
        """Move every KV head's held tokens into one row of slots, tagged by head (``shares_slots``): a context is
        read with a row per head (attention over rows of their own is the faster) and pooled once compressed."""
        batch, heads, used = *self.valid.shape[:2], self.used
        valid = self.valid[:, :, :used].reshape(batch, heads * used)
        pooled = int(valid.sum(1).max())
        take = torch.argsort((~valid).byte(), dim=1, stable=True)[:, None, :pooled]  # held first, head by head
        for name, buf in self.buffers():
            flat = buf[:, :, :used].reshape(batch, 1, heads * used, *buf.shape[3:])
            setattr(self, name, flat.gather(2, take if buf.dim() == 3 else
                                            take[..., None].expand(-1, -1, -1, buf.shape[-1])))
        self.head = take // used
        self.fan, self.used, self.peak_tokens = heads, pooled, self.peak_tokens * heads

    def keep_highest(self, view: TokenView, keep_count: torch.Tensor) -> torch.Tensor:
        """The ``keep_count`` (``[batch, rows]``) highest-priority valid slots of each row (ties: the newer), pinned
        prefix tokens first of all."""
        valid = view.valid
        t = valid.shape[-1]
        pinned = (view.index < self.pinned) & valid if self.pinned else None  # a prompt prefix: never evicted
        priority = self.policy.priority(view).masked_fill(~valid, -torch.inf)
        # ascending (priority, index): the first t - keep_count slots of each row are dropped
        by_index = torch.argsort(view.index, dim=-1, stable=True)
        order = by_index.gather(-1, torch.argsort(priority.gather(-1, by_index), dim=-1, stable=True))
        if pinned is not None:  # pinned tokens last, above even the policy's protected (infinite) ones
            order = order.gather(-1, torch.argsort(pinned.gather(-1, order).byte(), dim=-1, stable=True))
        drop_rank = torch.arange(t, device=self.device).expand_as(order) < (t - keep_count)[..., None]
        return torch.ones_like(valid).scatter_(-1, order, ~drop_rank)

    def drop_lowest(self, view: TokenView, over: torch.Tensor) -> torch.Tensor:
        """``view.valid`` less, in each row that is ``over`` the budget (``[batch, heads, 1]``), its lowest-priority
        token that is not a pinned prefix token (ties: the older): one decode step's eviction."""
        valid, slot = view.valid, self.lowest_slot(view)
        return valid.clone().scatter_(-1, slot, valid.gather(-1, slot) & ~over)

    def lowest_slot(self, view: TokenView) -> torch.Tensor:
        """Each row's slot (``[batch, heads, 1]``) of its lowest-priority token that is not a pinned prefix token
        (ties: the older)."""
        evictable = view.valid & (view.index >= self.pinned) if self.pinned else view.valid
        priority = self.policy.priority(view).masked_fill(~evictable, torch.inf)
        candidates = (priority == priority.min(-1, keepdim=True).values) & evictable
        return view.index.masked_fill(~candidates, torch.iinfo(torch.long).max).argmin(-1, keepdim=True)

    def free_or_lowest_slot(self, seen: torch.Tensor) -> torch.Tensor:
        """Where a fixed step's token goes (``[batch, heads, 1]``): the first free one of the fixed slots (a row that
        was fed padding, or forgot tokens, may hold fewer than the others, or holes where it never evicted), or,
        where none is free, the slot of the lowest-priority token. An order policy's layers lay their slots out alike
        (``query_view``): one search a step serves every layer with the same view (a profile of a compiled SmolLM2
        streaming step put a search at ~8 us: 30 a step)."""
        slots, view = self.fixed_slots, self.query_view()
        return memoized(self.cache.step.memo if view is not None else None,
                        ("fixed slot", slots, view, self.pinned, self.valid.shape),
                        lambda: self._free_or_lowest_slot(seen, slots))

    def _free_or_lowest_slot(self, seen: torch.Tensor, slots: int) -> torch.Tensor:
        valid = self.valid[:, :, :slots]
        # (a minimum over slot numbers, ``slots`` where none is free: inductor lowers an argmax over booleans with
        # an extra any() pass over them)
        first_free = torch.where(valid, slots, torch.arange(slots, device=valid.device)).amin(-1, keepdim=True)
        if slots != self.slot_budget:  # (unbounded, or a sequence shorter than the budget): never evicts, one is free
            return first_free
        return torch.where(first_free < slots, first_free, self.lowest_slot(self.view(seen)))

    def _overwrite(self, slot: torch.Tensor, newest: int) -> None:
        """Every row is one token over its budget, its newest in slot ``newest``: move that token's state into the
        row's ``slot`` (a copy onto itself where the newest is the one evicted) and free ``newest``. A decode step's
        eviction in one copy per buffer; ``_compact`` would do the same with a search for holes and movers."""
        batch, heads = slot.shape[:2]
        rows = (torch.arange(batch, device=slot.device)[:, None], torch.arange(heads, device=slot.device)[None, :],
                slot[..., 0])
        incoming = {} if self.incoming is None else self.encoded(*self.incoming)
        for name, buf in self.buffers():
            buf[rows] = incoming[name][:, :, 0] if name in incoming else buf[:, :, newest].clone()
        self.incoming = None
        self.valid[:, :, self.slots(newest, newest + 1)] = False
        self.used, self.stored = newest, 0

    def _compact(self, kept: torch.Tensor, keep_count: torch.Tensor, moves: int | None = None,
                 used: int | None = None) -> None:
        """Move kept tokens from behind ``keep_count`` into the holes in front of it. ``moves`` (at least the most
        holes of any row) and ``used`` (the most kept of any row) may be given when the caller knows them; else
        they are read from the device."""
        self.stored = 0  # (the last slots no longer hold the call's own tokens)
        t = kept.shape[-1]
        slot = torch.arange(t, device=self.device)
        front = slot < keep_count[..., None]
        holes = front & ~kept
        movers = ~front & kept
        if moves is None:
            moves = int(holes.sum(-1).max())
        if moves:
            # pair the i-th hole with the i-th mover of each row; rows with fewer pairs copy the last slot onto
            # itself (never a destination: holes exist only in front of keep_count < t)
            dst = torch.where(holes, slot, t).topk(moves, dim=-1, largest=False).values
            src = torch.where(movers, slot, t).topk(moves, dim=-1, largest=False).values
            real = dst < t
            dst = torch.where(real, dst, t - 1)
            src = torch.where(real, src, t - 1)
            for _, buf in self.buffers():
                if buf.dim() == 4:
                    idx_src = src[..., None].expand(-1, -1, -1, buf.shape[-1])
                    idx_dst = dst[..., None].expand(-1, -1, -1, buf.shape[-1])
                else:
                    idx_src, idx_dst = src, dst
                buf.scatter_(2, idx_dst, buf.gather(2, idx_src))
        if used is None:
            used = int(keep_count.max()) if keep_count.numel() else 0
        self.valid[:, :, :t] &= front
        self.used = used

    # --- what transformers asks of a cache layer ---
    def get_seq_length(self) -> int:
        return self.cache.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return (self.fixed_slots if self.cache.fixed_step else self.used) + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the same question, as transformers < 5.2 names it

    def reset(self) -> None:
        self.used = self.pending = self.peak_tokens = 0
        self.may_evict = False
        self.parked = 0
        self.fan = 1
        self.storage = None
        self.is_initialized = False
        for name in BUFFERS + ROW_STATE:
            setattr(self, name, None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name, buf in self.buffers() + self.row_state():
            setattr(self, name, buf.index_select(0, beam_idx.to(buf.device)))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("an EvictionCache cannot be cropped: evicted tokens are gone")
