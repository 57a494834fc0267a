"""Eviction policies by name."""

from sparsegen.kv.policies.adakv import AdaKV
from sparsegen.kv.policies.full import Full
from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policies.keydiff import KeyDiff
from sparsegen.kv.policies.knorm import Knorm
from sparsegen.kv.policies.lagkv import LagKV
from sparsegen.kv.policies.pyramid import Pyramid
from sparsegen.kv.policies.random import Random
from sparsegen.kv.policies.scissorhands import Scissorhands
from sparsegen.kv.policies.snapkv import SnapKV
from sparsegen.kv.policies.streaming import Streaming
from sparsegen.kv.policies.streaming_h2o import StreamingH2O
from sparsegen.kv.policies.tova import TOVA
from sparsegen.kv.policies.window import Window

POLICIES = {p.name: p for p in (Full, Window, Streaming, H2O, StreamingH2O, TOVA, Scissorhands, SnapKV, Knorm,
                                       KeyDiff, LagKV, Random, Pyramid, AdaKV)}
OPTIONS = {"full": (), "window": (), "streaming": ("sinks",), "h2o": ("sinks", "recent", "heavy"),
           "streaming-h2o": ("sinks", "recent", "heavy"), "tova": (), "knorm": (),
           "random": (), "pyramid": ("sinks",), "keydiff": (), "lagkv": ("sinks",),
           "scissorhands": ("sinks", "recent", "heavy", "history"), "snapkv": ("sinks",), "adakv": ("sinks", "recent", "heavy")}  # the budget splits each policy takes


def parse_budget(budget: int | float | str) -> int | float:
    """A budget as given: a positive token count, or a fraction in (0, 1] of the input (``"0.2"`` or ``0.2``)."""
    if isinstance(budget, str):
        try:
            budget = float(budget) if any(c in budget for c in ".eE") else int(budget)
        except ValueError:
            raise ValueError(f"budget must be a token count or a fraction like 0.2, got {budget!r}") from None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget must be a token count or a fraction like 0.2, got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"a budget fraction must be in (0, 1], got {budget}; give a token count as an integer")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}")
    return budget


def resolve_budget(budget: int | float | str, input_length: int | None = None) -> int:
    """A token count, or a fraction in (0, 1] of ``input_length`` (``"0.2"`` or ``0.2``)."""
    budget = parse_budget(budget)
    if isinstance(budget, float):
        if input_length is None:
            raise ValueError("a fractional budget needs the input length; give a token count instead")
        return max(1, round(budget * input_length))
    return budget


def make_policy(
    name: str,
    budget: int | float | str | None = None,
    input_length: int | None = None,
    sinks: int | None = None,
    recent: int | None = None,
    heavy: int | None = None,
    history: int | None = None,
):
    """Build a policy by name, checking that every option given applies to it."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    options = {"sinks": sinks, "recent": recent, "heavy": heavy, "history": history}
    extra = [k for k, v in options.items() if v is not None and k not in OPTIONS[name]]
    if extra:
        raise ValueError(f"policy {name!r} takes no --{' --'.join(extra)}")
    if name == "full":
        if budget is not None:
            raise ValueError("policy 'full' keeps everything and takes no budget")
        return Full()
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget (tokens, or a fraction of the input length)")
    tokens = resolve_budget(budget, input_length)
    return POLICIES[name](tokens, **{k: v for k, v in options.items() if v is not None})
