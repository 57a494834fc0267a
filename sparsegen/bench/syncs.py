"""Counting the host reads of device values in a decode step: what stops a step from running ahead of the host.

On a GPU each such read (``int(t)``, ``bool(t)``, ``t.item()``, ``nonzero``, a boolean-mask index, a copy to the
CPU) drains the stream; anywhere, a value that decides a shape or a branch on the host keeps ``torch.compile`` from
capturing the step whole (or CUDA graphs from replaying it). The count is taken at the dispatcher, so every read is
seen, the model's own and transformers' included. On the CPU these reads cost no transfer, but they are the same
reads: a step with none is one a compiler can take whole.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose result the host must read (a scalar, or a shape that depends on the data)
READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
         aten.nonzero.default, aten.nonzero_numpy.default, aten.masked_select.default, aten.unique_consecutive.default,
         aten._unique2.default}
SCALAR = ("_local_scalar_dense", "item", "is_nonzero")


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.count`` (and ``syncs.ops``: which ops, how often)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or _bool_index(func, args) or _to_host(func, args, kwargs):
            name = func.overloadpacket.__name__  # int(), float(), bool(), .item(): one scalar read, however dispatched
            self.ops["scalar" if name in SCALAR else "nonzero" if name == "nonzero_numpy" else name] += 1
        return func(*args, **kwargs)


def _bool_index(func, args) -> bool:
    """``t[mask]`` with a boolean mask: its shape is the mask's count of True."""
    if func is not aten.index.Tensor or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def _to_host(func, args, kwargs) -> bool:
    """A copy of a device tensor to the CPU (``.cpu()``, ``.tolist()`` of a CUDA tensor, ``.to("cpu")``)."""
    if func not in (aten._to_copy.default, aten.copy_.default) or not args:
        return False
    source = args[1] if func is aten.copy_.default else args[0]
    target = args[0].device if func is aten.copy_.default else kwargs.get("device")
    return isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None \
        and torch.device(target).type == "cpu"


class CudaSyncs:
    """The CUDA runtime's own count of the calls that made the host wait for the GPU (``set_sync_debug_mode("warn")``
    warns at each), for a step that may run compiled or as a CUDA graph, where a dispatcher mode sees nothing."""

    def __enter__(self) -> CudaSyncs:
        self._catching = warnings.catch_warnings(record=True)
        self._warnings = self._catching.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catching.__exit__(*exc)

    @property
    def ops(self) -> dict[str, int]:
        count = sum("synchronizing" in str(w.message) for w in self._warnings)
        return {"cuda_sync": count} if count else {}

    @property
    def count(self) -> int:
        return sum(self.ops.values())


def count_syncs(device: torch.device) -> HostSyncs | CudaSyncs:
    """How a step's host syncs are counted on ``device``: by the CUDA runtime on a GPU, at the dispatcher elsewhere."""
    return CudaSyncs() if device.type == "cuda" else HostSyncs()
