"""The contract between the cache and an eviction policy.

A policy only says how much to keep and which tokens matter most: ``priority`` returns a number per
cached token (higher = keep). The cache keeps the ``budget`` highest-priority tokens of every layer and
KV head after each forward step (ties go to the more recent token) and does all the moving.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsegen.kv.rotary import Rotary


@dataclass(frozen=True)
class TokenView:
    """What a policy may look at, per ``[batch, kv_head, slot]`` of one layer's cache."""

    index: torch.Tensor  # int64: the token's ordinal among its sequence's real (non-pad) tokens
    valid: torch.Tensor  # bool: the slot holds a real token
    seen: torch.Tensor  # int64 [batch]: real tokens seen so far, the current step's included
    attention: torch.Tensor | None  # fp32: attention each token has received, summed over all queries so far
    # (or as the policy's ``attention_statistic`` says), over the KV head's query heads
    keys: torch.Tensor | None = None  # the held keys [batch, kv_head, slot, head_dim]: rotated at their original
    # position, or not rotated at all under rolling positions (norms and dot products between keys agree)
    values: torch.Tensor | None = None  # the held values [batch, kv_head, slot, head_dim] (where needs_values)
    head: torch.Tensor | None = None  # where a layer's heads share slots (``shares_slots``): each slot's KV head, the
    heads: int = 1  # number of them; every tensor above is then [batch, 1, slot, ...]
    memo: torch.Tensor | None = None  # float64 [batch, kv_head, slot, memo_width]: the policy's own numbers per token
    # (policies that set memo_width), NaN until ``memorize`` writes them; the cache moves them with the tokens
    queries: torch.Tensor | None = None  # fp32 [batch, query_head, head_dim + 1, head_dim + 1] (``needs_queries``):
    # per query head (a KV head's are consecutive), the sums of x x^T over the real queries seen past the policy's
    # ``sinks``, where x is a query un-rotated and times attention's scaling, with a 1 appended: their count, sum and
    # second moments
    rotary: Rotary | None = None  # the layer's rotary embedding (``needs_queries``; None: the model has no RoPE)
    new: int = 0  # the tokens the latest call stored: the view's last ``new`` slots (a decode step's: 1)

    def is_recent(self, recent: int) -> torch.Tensor:
        return self.index >= (self.seen - recent)[:, None, None]

    def is_sink(self, sinks: int) -> torch.Tensor:
        return self.index < sinks


class Policy:
    """Base class. ``budget`` None means unbounded (nothing is evicted)."""

    name: ClassVar[str]
    needs_attention: ClassVar[bool] = False
    # what ``attention`` holds: "sum" over all queries (H2O), the "latest" query's (TOVA), or how often it was
    # "pivotal", above the average 1/n (Scissorhands), or the "max" any query paid (KVzip)
    attention_statistic: ClassVar[str] = "sum"
    needs_keys: ClassVar[bool] = False
    needs_values: ClassVar[bool] = False
    default_positions: ClassVar[str] = "original"
    # the layer's KV heads hold their tokens in one pool of budget x heads slots, each head as many as the policy
    # gives it (per-head budgets that save memory); the budget is then the mean per head
    shares_slots: ClassVar[bool] = False

    history: int | None = None  # count only the latest `history` queries' attention (None: all of them)
    memo_width: ClassVar[int] = 0  # numbers per token the policy keeps in ``TokenView.memo`` (0: none)
    memo_per_query_head: ClassVar[bool] = False  # ... ``memo_width`` for each of the KV head's query heads
    # its decode step reads device values on the host to choose (so it cannot be compiled as one graph)
    reads_host: ClassVar[bool] = False
    # a multi-token call's evictions wait until every layer has attended, and ``share`` sees them all first
    across_layers: ClassVar[bool] = False
    # a fresh cache's first pass (a context, or the whole prompt) is encoded whole, evicting nothing, and compressed
    # once at its end (``sparsegen.engine.reconstruct``): a query-agnostic score of a context as a whole
    compresses_whole: ClassVar[bool] = False
    # ... scored, before that compression, by the attention the model pays the context while it reads it again right
    # after it (KVzip)
    reconstructs: ClassVar[bool] = False
    # the layer keeps running moments of the queries it sees (``TokenView.queries``)
    needs_queries: ClassVar[bool] = False
    # (with ``compresses_whole``) the compression ranks every layer's priorities together: the layers' budgets sum to
    # the model's, and each layer's becomes what its tokens won (``EvictionCache.compress``)
    budget_across_layers: ClassVar[bool] = False

    def __init__(self, budget: int | None):
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        self.budget = budget

    def priority(self, view: TokenView) -> torch.Tensor:
        raise NotImplementedError

    def memorize(self, view: TokenView) -> None:
        """Write ``view.memo`` in place, after a call stored new tokens or the newest were forgotten: a score that
        costs a pass over the keys is computed once per token here, not at every eviction. ``view`` carries the held
        keys and values (as ``TokenView.keys`` says) whatever ``needs_keys`` says."""

    def share(self, views: list[TokenView]) -> None:
        """Policies that set ``across_layers`` (and a ``memo_width``): write each layer's ``views[i].memo`` in place
        from every layer's view, once a multi-token call has been attended in all layers and before any of them
        evicts, so that one layer can keep what another layer's attention found. Views come in layer order, one per
        layer under this policy (not Gemma 3's sliding-window layers, which keep their window)."""

    def query_view(self) -> tuple[int, int] | None:
        """``(sinks, recent)`` if each token sees exactly the first ``sinks`` tokens and the ``recent`` before
        it (a kept set fixed by token order), which lets a whole chunk be computed as if fed token by token.
        None when the kept set depends on attention."""
        return None

    def for_layer(self, index: int, layers: int) -> Policy:
        """The policy layer ``index`` of ``layers`` runs (itself; PyramidKV-style policies give each layer its own
        budget, and the layer's storage is sized by it)."""
        return self

    def with_budget(self, budget: int | None) -> Policy:
        """This policy with another budget, its other options as they are (a layer's own share of the model's)."""
        own = copy.copy(self)
        own.budget = budget
        return own

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model this policy cannot run on (a learned scorer fit on another); called as a cache is built."""

    def describe(self) -> dict:
        return {"policy": self.name, "budget": self.budget}


POLICIES: dict[str, type[Policy]] = {}  # name -> class: every policy registered (``register_policy``)


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name`` everywhere a policy is named (``make_policy``, the
    CLI's ``--policy``, saved contexts, the test matrices). Its options are its constructor's keyword arguments."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or not isinstance(getattr(cls, "name", None), str):
        raise TypeError("register_policy takes a Policy subclass with a name")
    known = POLICIES.get(cls.name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"a policy named {cls.name!r} is already registered ({known.__module__}.{known.__qualname__})")
    POLICIES[cls.name] = cls
    return cls


def policy_options(cls: type[Policy]) -> tuple[str, ...]:
    """The options a policy takes besides its budget: its constructor's parameters."""
    parameters = inspect.signature(cls.__init__).parameters
    return tuple(name for name in list(parameters)[1:] if name != "budget"
                 and parameters[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
