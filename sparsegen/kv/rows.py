"""A server's batch: the caches of separate sequences (each fed alone, built alike) stacked as the rows of one cache,
so their decode steps run as one batch; a row joins (``add_row``) or leaves (``remove_row``, written back into the
cache it came from) one at a time, and a row's own cache lets go of its slots while the batch holds them (``park``).
"""

from __future__ import annotations

import torch

from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.layer import BUFFERS, ROW_STATE, EvictionLayer


def stack(model: torch.nn.Module, caches: list[EvictionCache], capacity: int = 1,
          exact: bool = False) -> EvictionCache:
    """A cache whose rows are copies of ``caches`` (each of one sequence, already fed, built alike), so their
    decode steps run as one batch. Rows may hold different numbers of tokens and sit at different positions
    (pass ``position_ids``). ``add_row``/``remove_row`` change the rows one at a time; storage for
    ``capacity`` rows is kept so that neither moves more than one row. ``exact``: storage for the rows present
    only, reallocated one layer at a time as a row comes or goes (a memory cap counts every byte)."""
    if not caches:
        raise ValueError("stack() needs at least one cache")
    batched = EvictionCache(model, caches[0].policy, caches[0].positions, chunk_size=1, kv_bits=caches[0].kv_bits,
                  max_length=caches[0].max_length)
    batched.row_capacity = max(capacity, len(caches))
    batched.exact_rows = exact
    batched.padded = True  # rows hold different numbers of tokens: every attention needs its mask
    for cache in caches:
        add_row(batched, cache)
    return batched

def add_row(batch: EvictionCache, source: EvictionCache) -> None:
    """Append a copy of ``source`` (one fed sequence) as the last row."""
    same_policy = source.policy is batch.policy or source.policy.describe() == batch.policy.describe()
    if source.seen is None or source.seen.shape[0] != 1 or not same_policy \
            or source.quantization != batch.quantization:
        raise ValueError("add_row() takes a fed cache of one sequence built with the same policy and kv_bits")
    if any(layer.policy.budget != row.policy.budget for layer, row in zip(batch.layers, source.layers)):
        raise ValueError("add_row() takes caches whose layers hold the batch's budgets (a policy whose budget spans "
                         "the layers gives each context its own shares)")
    rows = 0 if batch.seen is None else batch.seen.shape[0]
    for layer, row in zip(batch.layers, source.layers):
        layer.fan = row.fan
        slots = max(row.used, layer.capacity(1) if layer.policy.budget is not None
                    else layer.most_slots(1) if batch.max_length else row.used + 64)
        storage = layer.storage
        if storage is None or rows == storage["keys"].shape[0] or row.used > storage["keys"].shape[2] \
                or storage["keys"].data_ptr() != layer.keys.data_ptr():  # full, or replaced by _grow
            layer.storage = _row_storage(batch, layer, row, rows, slots)
        storage = layer.storage
        for name, buf in row.buffers():
            storage[name][rows, :, :row.used] = buf[0, :, :row.used]
        for name, buf in row.row_state():
            storage[name][rows] = buf[0]
        storage["valid"][rows, :, row.used:] = False
        for name in BUFFERS + ROW_STATE:
            setattr(layer, name, storage[name][:rows + 1] if name in storage else None)
        layer.used = max(layer.used, row.used)
        layer.peak_tokens = max(layer.peak_tokens, layer.used)
        layer.may_evict = layer.may_evict or row.may_evict  # (a row that evicted and then forgot tokens)
    batch.seen = source.seen.clone() if batch.seen is None else torch.cat([batch.seen, source.seen])
    batch.length = max(batch.length, source.length)

def _row_storage(batch: EvictionCache, layer: EvictionLayer, row: EvictionLayer, rows: int,
                 slots: int) -> dict:
    """Buffers for ``row_capacity`` rows (more if full) of at least ``slots`` slots, holding the current rows."""
    capacity = rows + 1 if batch.exact_rows else max(batch.row_capacity, 2 * rows, rows + 1)
    if layer.is_initialized:
        slots = max(slots, layer.keys.shape[2])
    storage = {}
    for name, buf in row.buffers():
        new = buf.new_zeros(capacity, buf.shape[1], slots, *buf.shape[3:])
        if layer.is_initialized:
            old = getattr(layer, name)
            new[:rows, :, :old.shape[2]] = old
        storage[name] = new
    for name, buf in row.row_state():
        new = buf.new_zeros(capacity, *buf.shape[1:])
        if layer.is_initialized:
            new[:rows] = getattr(layer, name)
        storage[name] = new
    layer.dtype, layer.device, layer.is_initialized = row.dtype, row.device, True
    return storage


def park(cache: EvictionCache) -> None:
    """Let go of the slots of this one-sequence cache while a stacked cache holds its row (``add_row``), so a
    decoding conversation is held once, not twice; ``remove_row`` gives it back its allocation. Counts, scores
    of what it held and quantization state stay."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.parked = layer.keys.shape[2]
            for name, buf in layer.buffers():
                setattr(layer, name, buf[:, :, :0].clone())


def remove_row(batch: EvictionCache, index: int, into: EvictionCache, steps: int) -> None:
    """Write row ``index`` back into ``into`` (the cache it came from, which ran ``steps`` more tokens here; parked
    or not) and close the gap with the last row."""
    last = batch.seen.shape[0] - 1
    for layer, row in zip(batch.layers, into.layers):
        valid = layer.valid[index, :, :layer.used]
        held = int(valid.sum(-1).max())
        slots = torch.argsort((~valid).byte(), dim=-1, stable=True)[:, :held]  # the valid ones (order is free)
        if held > row.keys.shape[2]:  # parked (back to the slots it had), or it holds more now
            row._grow(max(held, row.parked))
        row.parked = 0
        for (_, src), (_, dst) in zip(layer.buffers(), row.buffers()):
            take = slots if src.dim() == 3 else slots[..., None].expand(-1, -1, src.shape[-1])
            dst[0, :, :held] = src[index, :, :layer.used].gather(1, take)
        row.valid[0, :, held:] = False
        row.used, row.peak_tokens = held, max(row.peak_tokens, held)
        row.may_evict = row.may_evict or layer.may_evict  # (some row evicted: perhaps this one)
        for (_, src), (_, dst) in zip(layer.row_state(), row.row_state()):
            dst[0] = src[index]
        for name, buf in layer.buffers() + layer.row_state():
            if index != last:
                buf[index] = buf[last]
            setattr(layer, name, buf[:last])
        if batch.exact_rows and last:  # storage for the rows left only, one layer at a time
            layer.storage = {name: buf.clone() for name, buf in layer.buffers() + layer.row_state()}
            for name, buf in layer.storage.items():
                setattr(layer, name, buf)
    into.seen = batch.seen[index:index + 1].clone()
    into.length += steps
    batch.seen = torch.cat([batch.seen[:index], batch.seen[last:last + 1], batch.seen[index + 1:last]]) \
        if index != last else batch.seen[:last]
