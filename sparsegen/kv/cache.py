"""A transformers ``Cache`` that really evicts: each layer (``sparsegen.kv.layer``) holds at most ``budget`` tokens
per KV head; this container builds the layers, runs the per-call bookkeeping the model's hook drives, and keeps the
decode step's shapes fixed for a compiler.

With ``positions="rolling"`` attention sees every key at its rank in the cache (StreamingLLM), so positions never
exceed the budget: keys are stored without their rotary embedding and rotated to their rank at attention time or,
under an order policy (sinks + one recent run), stored turned to their token ordinal, which puts every recent key at
its rolling distance from the query already (only the query turns, twice: once for the recent run, once for the
sinks, which needs a turn of its own only once a token has been evicted).

A server's batches of separate sequences are ``sparsegen.kv.rows``; forgetting the newest tokens (speculative
decoding) is ``sparsegen.kv.rollback``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from sparsegen.kv import native_attention
from sparsegen.kv.attention import prepare
from sparsegen.kv.layer import KV_BUFFERS, ROW_STATE, EvictionLayer, Step
from sparsegen.kv.policies.full import Full
from sparsegen.kv.policies.window import Window
from sparsegen.kv.policy import Policy
from sparsegen.kv.quantized import AS_COMPUTED, KVQuantization, held_kv
from sparsegen.kv.rotary import Rotary
from sparsegen.models.anatomy import pinned_tokens

DEFAULT_CHUNK = 512
# the counts a fixed step keeps outside its graph (``fixed_shape_step``): they change every step, the graph reads none
HOST_COUNTS = frozenset({"length", "used", "peak_tokens"})
HELD_SLOTS_BUCKET = 256  # slots ``stop_evicting`` rounds each layer's allocation up to
_BY_VALUE = frozenset({int, float, str, bool, type(None), torch.dtype, torch.device})  # tensors: by identity and
# layout (a buffer let go and a new one may share an identity); the rest by identity


class EvictionCache(Cache):
    """Pass to a model prepared by ``sparsegen.kv.prepare`` (the constructor does it) as its cache:
    ``**cache_kwargs(cache)``."""

    evicting = True  # how the prepared model's attention tells this cache from transformers' own caches

    def __init__(self, model: torch.nn.Module, policy: Policy, positions: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK, expected_length: int | None = None, stepwise: bool = False,
                 rollback: int = 0, kv_bits: int | KVQuantization | None = None, max_length: int | None = None):
        """``expected_length``: tokens per row the caller will feed in all, if known; an unbounded (``full``)
        cache then allocates once instead of growing (and briefly holding two copies). ``max_length``: the most
        tokens per row an unbounded cache will hold (a server's ``--max-context``): its slots never grow past it,
        so its memory is known in advance as a bounded policy's is.

        ``stepwise``: every query of a multi-token call sees exactly the cache that feeding the tokens one per
        call would leave it, evictions between tokens included (what streaming perplexity measures). Order
        policies do so anyway; attention policies (H2O) then replay the per-token steps inside each layer. Without
        it, a prefill chunk's queries see the held tokens and the whole chunk causally, and eviction follows.

        ``rollback``: tokens a caller may ``forget_last`` after a call (speculative decoding). Sliding-window layers
        then hold that many tokens beyond their window (attention still sees only the window), so that forgetting
        never leaves them short of it.

        ``kv_bits`` (8, 4 or 2, or a ``KVQuantization`` to set the residual too): hold keys and values as low-bit
        codes (``sparsegen.kv.quantized``); 16 holds them as float16 numbers (llama.cpp's default cache type); 32
        (``AS_COMPUTED``) as the model computes them; None: the model's default (``default_kv_bits``: 16 on a CPU
        where its linears run in the integer kernels, else 32)."""
        prepare(model)
        policy.check_model(model)
        self.quantization = held_kv(model, kv_bits)
        self.kv_dtype = torch.float16 if self.quantization is not None and not self.quantization.codes else None
        positions = positions or policy.default_positions
        if positions not in ("original", "rolling"):
            raise ValueError(f"positions must be 'original' or 'rolling', got {positions!r}")
        self.rolling = positions == "rolling"
        if self.rolling and policy.needs_queries:
            raise ValueError(f"policy {policy.name!r} turns its queries to the positions that follow the text, which "
                             "rolling positions do not have: use positions='original' (--positions original)")
        if self.rolling and policy.shares_slots:
            raise ValueError(f"policy {policy.name!r} holds a different number of tokens per head, so a key has no "
                             "single rank in the cache to rotate to: use positions='original' (--positions original)")
        if chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        self.policy, self.positions, self.chunk_size, self.stepwise = policy, positions, chunk_size, stepwise
        if rollback < 0:
            raise ValueError("rollback must be >= 0")
        self.rollback = rollback
        self.query_heads = model.config.get_text_config().num_attention_heads  # (a layer's query moments, if kept)
        self.pinned = pinned_tokens(model)  # the first tokens of every sequence are a prompt prefix: never evicted
        if policy.budget is not None and policy.budget <= self.pinned:
            raise ValueError(f"a budget of {policy.budget} tokens cannot hold the model's {self.pinned}-token prompt "
                             f"prefix (never evicted) and any text; raise the budget above {self.pinned}")
        self.expected_length = expected_length or 0
        # what the decode step reads of it (a compiled step guards on the Python values it reads: the length itself
        # would compile the step anew for every announced length, every generate call)
        self.length_announced = bool(expected_length)
        if max_length is not None and max_length < 1:
            raise ValueError("max_length must be at least 1")
        self.max_length = max_length
        super().__init__(layers=self._layers(model))
        self.step: Step | None = None
        self.deferred: list[EvictionLayer] = []  # layers whose eviction waits for the end of the call
        self.length = 0  # tokens fed per row, padding included (what generate and the model count as past)
        self.seen: torch.Tensor | None = None  # real tokens per sequence
        self.padded = False  # whether any padding was fed: until then every held slot of every row is real
        # a fixed-shape decode step is running (``fixed_shape_step``): every layer attends over its ``fixed_slots``
        # and writes the token into one of them; the counts (``length``, ``used``) are kept outside the step
        self.fixed_step = False
        self.row_capacity = 1  # rows a stacked cache keeps storage for
        self.exact_rows = False  # a stacked cache holds storage for its rows only (reallocated as they come and go)
        self._workspace: torch.Tensor | None = None
        self.block_step = None  # a decode step running the layers a block at a time (``sparsegen.kv.regions``)
        # the ordinals [first, end) of the context's tokens a chunk of KVzip's copy reads again (``reconstruct``)
        self.reading_again: tuple[int, int] | None = None
        # decode steps attend through ``sparsegen::decode_attention`` (built here, outside any compiled step)
        self.native_decode = next(model.parameters()).device.type == "cpu" and native_attention.ready()
        self.mark_evicting(self.expected_length)  # (an announced length past the budget: one compiled graph)

    def _layers(self, model: torch.nn.Module) -> list[EvictionLayer]:
        """One layer each; sliding-window layers of a model that mixes them with global ones keep their window
        (and rotate with their own RoPE, which may differ from the global layers')."""
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        mixed = "sliding_attention" in layer_types and getattr(config, "sliding_window", None)
        rotaries: dict[str, Rotary] = {}
        layers = []
        for i, layer_type in enumerate(layer_types):
            # (a policy that turns its queries to later positions: by each layer's own RoPE, where the model has one)
            ropes = self.rolling or (self.policy.needs_queries and hasattr(model.get_decoder(), "rotary_emb"))
            if ropes and layer_type not in rotaries:
                rotaries[layer_type] = Rotary.of(model, i)
            rotary = rotaries.get(layer_type)
            if mixed and layer_type == "sliding_attention":
                window = Window(config.sliding_window - 1 + self.rollback)
                layers.append(EvictionLayer(self, i, window, pinned=0, rotary=rotary, is_sliding=True))
            else:
                layers.append(EvictionLayer(self, i, self.policy.for_layer(i, len(layer_types)), self.pinned,
                                            rotary))
        return layers

    def layer_for(self, index: int) -> EvictionLayer:
        """Layer ``index``'s state (inside a block step a layer asks its ``LayerView``, which answers with its own)."""
        return self.layers[index]

    def workspace(self, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor of ``shape``, reused by every layer and step: large temporaries allocated anew each
        time cost page faults that, on CPU, can take longer than the arithmetic. Under a
        compiler the scratch is the compiler's own (a tensor allocated in a CUDA graph and kept would be overwritten
        by its next replay)."""
        if torch.compiler.is_compiling():
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        size = shape.numel()
        if self._workspace is None or self._workspace.numel() < size or self._workspace.dtype != like.dtype \
                or self._workspace.device != like.device:
            self._workspace = torch.empty(size, dtype=like.dtype, device=like.device)
        return self._workspace[:size].view(shape)

    # --- driven by the hook around the decoder's forward ---
    def begin_step(self, batch: int, q: int, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor | None, device: torch.device) -> None:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("EvictionCache needs a 2D padding mask (batch, length); custom 4D masks are not supported")
        if self.seen is None:
            self.seen = torch.zeros(batch, dtype=torch.long, device=device)
        elif self.seen.shape[0] != batch:
            raise ValueError(f"this cache holds {self.seen.shape[0]} sequences but the input has {batch}")
        if attention_mask is None:
            new_valid = torch.ones(batch, q, dtype=torch.bool, device=device)
        else:
            if attention_mask.shape[-1] < q:
                raise ValueError("attention_mask is shorter than the input")
            new_valid = attention_mask[:, -q:].to(device=device, dtype=torch.bool)
            self.padded = self.padded or not bool(new_valid.all())
        if not self.fixed_step:  # (a fixed step's were marked by ``fits_fixed_step``, outside its graph)
            self.mark_evicting(self.length + q)
        if self.deferred:  # (left by a call that failed before its end; a compiled step finds it empty and never
            self.deferred.clear()  # mutates it, which its graph's replay could not repeat)
        new_index = self.seen[:, None] + new_valid.long().cumsum(-1) - 1
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + q, device=device)[None].expand(batch, q)
        self.step = Step(new_valid, new_index, position_ids.expand(batch, q), self.seen + new_valid.sum(-1))

    def end_step(self) -> None:
        if self.step is not None:
            if self.deferred:
                self._evict_across_layers()
            self.seen.copy_(self.step.seen)  # in place: a decode step's state stays at fixed addresses (CUDA graphs)
            if not self.fixed_step:
                self.length += self.step.new_valid.shape[1]
        self.step = None

    def _evict_across_layers(self) -> None:
        """The evictions the call deferred (``Policy.across_layers``): the policy sees every layer's view, then each
        layer evicts by its priority."""
        layers = list(self.deferred)
        self.deferred.clear()
        seen = self.step.seen
        self.policy.share([layer.view(seen) for layer in layers])
        for layer in layers:
            layer.evict(seen, now=True)

    def compress(self) -> None:
        """Compress a context encoded whole (``Policy.compresses_whole``), between calls: each layer keeps its budget's
        highest-priority tokens. Where a layer's heads share one pool (``shares_slots``) but held a row each while
        the context was read, or the budget spans the layers (``budget_across_layers``), the rows' shares come first
        from one ranking of the layer's, or of all those layers', priorities (``_share_budget``)."""
        layers = [layer for layer in self.layers if layer.is_initialized and layer.slot_budget is not None]
        across = [layer for layer in layers if layer.policy.budget_across_layers]
        groups = [across] if across else []
        groups += [[layer] for layer in layers if layer.policy.shares_slots and layer.fan == 1
                   and not layer.policy.budget_across_layers]
        keep = {}
        for group in groups:
            keep.update(zip(map(id, group), self._share_budget(group)))
        for layer in layers:
            layer.compress(self.seen, keep.get(id(layer)))

    def _share_budget(self, layers: list[EvictionLayer]) -> list[torch.Tensor]:
        """How many tokens each row of ``layers`` keeps (``[batch, rows]`` each): those among the top of all their
        priorities ranked together, as many as their budgets hold in all (a prompt prefix and what the policy
        protects always among them). Each layer's policy then takes as its budget its heads' share of the most any
        sequence keeps there, plus an even part of the slots the context left free (a context within the budget:
        the budget as it was), so the layers hold their budgets' total (at batch 1; a batch's layer, its largest
        sequence's share)."""
        flat = []
        for layer in layers:
            view = layer.view(self.seen)
            priority = layer.policy.priority(view)
            if layer.pinned:
                priority = priority.masked_fill(view.index < layer.pinned, torch.inf)
            flat.append(priority.masked_fill(~view.valid, -torch.inf).flatten(1))  # [batch, rows * slots]
        scores = torch.cat(flat, 1)
        total = sum(layer.slot_budget * layer.valid.shape[1] for layer in layers)
        top = scores.topk(min(total, scores.shape[1]), dim=1)
        won = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top.indices, top.values > -torch.inf)
        keep = [part.view(*layer.valid.shape[:2], -1).sum(-1)
                for layer, part in zip(layers, won.split([part.shape[1] for part in flat], dim=1))]
        free = (total - won.sum(1)) // len(layers)  # [batch]: each layer's part of the slots no token won
        for layer, count in zip(layers, keep):
            heads = count.shape[1] * layer.fan
            budget = max(1, -(-int((count.sum(-1) + free).max()) // heads))
            if budget != layer.policy.budget:
                layer.policy = layer.policy.with_budget(budget)
        return keep

    def fits_fixed_step(self) -> bool:
        """Whether the next decode step can be fixed-shape (``fixed_shape_step``), giving a bounded layer its spare slot
        if it has none yet: every layer with fixed slots and, if unbounded, one free. A bounded layer keeps the fixed
        slots, the spare one and its ``rollback`` only: the room a prefill chunk needed is let go (``update`` grows it
        back when a chunk comes), so a decoding cache holds a third less at budget 1,024 with chunks of 512, and a
        compiled step's bookkeeping, which copies whole slot buffers (inductor's functional updates), copies that much
        less. (The rollback's room: a speculative
        draft's two-token call after a round whose drafts were all accepted fits without growing.)"""
        if self.seen is None:
            return False
        self.mark_evicting(self.length + 1)
        for layer in self.layers:
            slots = layer.fixed_slots
            if slots is None or layer.used + (slots != layer.slot_budget) > slots:  # a free slot, if it cannot evict
                return False
        for layer in self.layers:
            room = layer.fixed_slots + 1 + self.rollback
            if layer.storage is not None:  # (a stacked cache's rows keep their allocation)
                if layer.keys.shape[2] <= layer.fixed_slots:
                    layer._grow(layer.fixed_slots + 1)
            elif layer.keys.shape[2] <= layer.fixed_slots or layer.keys.shape[2] > room:
                layer._reallocate(room)  # (one shape for every step after: one compile)
        return True

    def mark_evicting(self, length: int) -> None:
        """Before ``length`` tokens a row have been fed: mark the layers with rolling sinks where a row may then hold
        more than its budget (``EvictionLayer.may_evict``; a row's real tokens are at most ``length``, padding
        counted)."""
        for layer in self.layers:
            budget = layer.policy.budget
            if layer.sinks and not layer.may_evict and budget is not None and length > budget:
                layer.may_evict = True

    @contextmanager
    def fixed_shape_step(self):
        """Run one decode step (one token per row) in fixed shapes: each layer attends over its ``fixed_slots``
        (free ones masked) and writes the token into a free slot or the one it evicts, so every step, filling or
        evicting, has the same shapes and reads no count that changes: what one compiled graph (one CUDA graph)
        serves step after step. The counts are kept here, outside the step. Needs ``fits_fixed_step()``."""
        before = [layer.used for layer in self.layers]
        self.fixed_step = True
        try:
            yield
        finally:
            self.fixed_step = False
        self.length += 1
        for layer, used in zip(self.layers, before):
            layer.used = min(used + 1, layer.fixed_slots)
            layer.peak_tokens = max(layer.peak_tokens, used + 1)

    def step_fingerprint(self) -> tuple:
        """What a fixed step's compiled graph may depend on, to tell a step whose state dynamo's guards have passed
        from one they must check (``DecodeStep`` skips the guards for the first): every attribute of the cache, of
        its layers and of their policies, numbers by value, tensors by identity, shape and dtype, every other object
        by identity, less the counts ``fixed_shape_step`` keeps outside the graph. Equal fingerprints: the same
        buffers, shapes and settings, so the same graph."""
        policies = {id(layer.policy): layer.policy for layer in self.layers}
        fingerprint = []
        for attributes in map(vars, (self, *self.layers, *policies.values())):
            names = tuple(attributes)
            fingerprint.append(names)
            fingerprint.extend(value if type(value) in _BY_VALUE else
                               (id(value), value.shape, value.dtype) if isinstance(value, torch.Tensor) else id(value)
                               for value in _graph_attributes(names)(attributes))
        return tuple(fingerprint)

    def step_state(self) -> list[torch.Tensor]:
        """Every tensor a decode step updates in place: the layers' slots and row state, and the tokens seen."""
        return [self.seen] + [buf for layer in self.layers for _, buf in layer.buffers() + layer.row_state()]

    # --- what transformers asks of a cache ---
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where transformers' mask starts its queries: unused (sparsegen's attention builds its own mask from the
        slots), so a constant, not the length: a compiled decode step read the length and recompiled on the next."""
        return 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if not isinstance(query_length, int):  # older transformers pass cache_position
            query_length = query_length.shape[-1]
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        """Empty the cache and give its memory back (every buffer is let go, not zeroed)."""
        super().reset()
        self.length, self.seen, self.step, self.padded, self._workspace = 0, None, None, False, None
        self.mark_evicting(self.expected_length)

    def stop_evicting(self) -> None:
        """Hold every token fed from now on (what it holds stays): kvpress's protocol, where a context is compressed
        once and the question and answer that follow are never evicted. Sliding-window layers keep their window."""
        self.policy = Full()
        for layer in self.layers:
            if not layer.is_sliding:
                layer.policy = self.policy
                layer.attention = layer.memo = None  # (nothing scores the tokens any more)
                if layer.is_initialized and layer.keys.shape[2] % HELD_SLOTS_BUCKET:
                    # (a compiled decode step attends over an unbounded layer's allocation: rounded up, the contexts
                    # of nearby lengths that each kept its share share one graph, not one compile each)
                    layer._reallocate(-(-layer.keys.shape[2] // HELD_SLOTS_BUCKET) * HELD_SLOTS_BUCKET)

    # --- what users ask ---
    @property
    def kv_bits(self) -> KVQuantization | int:
        """How this cache holds K/V, as another cache of the same storage is asked for it (``AS_COMPUTED`` where the
        model's own dtype: None would take the model's default)."""
        return self.quantization or AS_COMPUTED

    def held_tokens(self) -> list[int]:
        """Tokens held per layer now: slots in use (the largest held count of any sequence), per head where the
        heads share slots."""
        return [layer.used // layer.fan for layer in self.layers]

    def held_bytes(self) -> int:
        """K and V bytes in the slots in use now (and a quantized cache's residual and channel scales), over all
        layers."""
        return sum(layer.used * layer.bytes_per_slot + layer.row_state_bytes for layer in self.layers)

    def allocated_bytes(self) -> int:
        """K and V bytes allocated now (a stacked cache's whole row capacity included), over all layers."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                buffers = layer.storage if layer.storage is not None else dict(layer.buffers() + layer.row_state())
                total += sum(buf.nbytes for name, buf in buffers.items() if name in KV_BUFFERS + ROW_STATE)
        return total

    def stats(self) -> dict:
        return {
            **self.policy.describe(),
            **(self.quantization.describe() if self.quantization else {}),
            "positions": self.positions,
            "kv_tokens": max(self.held_tokens(), default=0),
            "kv_tokens_peak": max((layer.peak_tokens // layer.fan for layer in self.layers), default=0),
            "kv_bytes_peak": sum(layer.peak_tokens * layer.bytes_per_slot + layer.row_state_bytes
                                 for layer in self.layers),
            "kv_bytes_allocated": self.allocated_bytes(),
            "tokens_seen": self.length,
        }


@functools.cache
def _graph_attributes(names: tuple[str, ...]) -> Callable[[dict], tuple]:
    """Reads an object's attributes ``names`` but the ``HOST_COUNTS`` from its ``vars()``, as a tuple (one getter
    per attribute layout: ``step_fingerprint`` runs every step)."""
    kept = [name for name in names if name not in HOST_COUNTS]
    if len(kept) > 1:
        return operator.itemgetter(*kept)
    return lambda attributes: tuple(attributes[name] for name in kept)
