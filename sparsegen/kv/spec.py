"""A cache's settings as one value: which policy at what budget with which options, how positions are held and in
how many bits the keys and values are. The API, the CLI, the server and the evaluations pass this around instead of
half a dozen keyword arguments, and it is checked when made, before a model is loaded or a request is taken (a
fractional budget's limits once it is resolved against an input's length)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.policies import check_settings, make_policy, resolve_budget
from sparsegen.kv.policy import Policy
from sparsegen.kv.quantized import KVQuantization, as_quantization, policy_and_bits

POSITIONS = ("original", "rolling")


@dataclass(frozen=True)
class PolicySpec:
    """``policy``: a registered name or a ``Policy`` already built (then ``budget`` and ``options`` are its own).
    ``budget``: tokens, or a fraction in (0, 1] of the input (resolved by ``build``); ``full`` takes none.
    ``options``: the policy's constructor options (``sinks``, ``recent``, ``heavy``, ``history``, ``window``...; None:
    its default). ``positions``: ``original`` or ``rolling`` (None: the policy's default). ``kv_bits``: hold K/V in
    8, 4 or 2 bits (16: float16), or a ``KVQuantization``; None keeps the model's dtype."""

    policy: str | Policy = "full"
    budget: int | float | str | None = None
    options: dict = field(default_factory=dict)
    positions: str | None = None
    kv_bits: int | KVQuantization | None = None

    def __post_init__(self):
        if isinstance(self.policy, Policy):
            if self.budget is not None or self.options:
                raise ValueError("a Policy instance carries its own budget and options: give its name instead to "
                                 "set them here")
        elif isinstance(self.policy, str):
            cls, budget, options = check_settings(self.policy, self.budget, dict(self.options))
            object.__setattr__(self, "budget", budget)
            object.__setattr__(self, "options", options)
            if not isinstance(budget, float):  # the constructor's own checks (a fraction's, once resolved)
                cls(**options) if budget is None else cls(budget, **options)
        else:
            raise ValueError(f"policy must be a policy's name or a Policy, got {self.policy!r}")
        if self.positions not in (None, *POSITIONS):
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        object.__setattr__(self, "kv_bits", as_quantization(self.kv_bits))

    @classmethod
    def parse(cls, text: str, **settings) -> PolicySpec:
        """``NAME[:BUDGET][+kvBITS]`` (``h2o:0.2``, ``streaming:1024+kv4``, ``full``) with ``settings`` (options,
        ``positions``, ``kv_bits``) as keywords."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a policy is written NAME[:BUDGET][+kvBITS], e.g. h2o:0.2 or streaming:1024+kv4")
        named, bits = policy_and_bits(text.strip())
        if bits is not None and settings.get("kv_bits") is not None:
            raise ValueError(f"{text!r} gives the K/V bits already: drop kv_bits")
        name, _, budget = named.partition(":")
        return cls.of(name, budget or None, kv_bits=settings.pop("kv_bits", None) if bits is None else bits,
                      **settings)

    @classmethod
    def of(cls, name: str, budget: int | float | str | None = None, *, positions: str | None = None,
           kv_bits: int | KVQuantization | None = None, **options) -> PolicySpec:
        """The flat form: ``PolicySpec.of("h2o", 0.2, heavy=64, kv_bits=4)``."""
        return cls(name, budget, options, positions, kv_bits)

    @classmethod
    def sharing(cls, name: str, budget: int | float | str | None, **settings) -> PolicySpec:
        """One of several policies a command runs at its one ``--budget``: ``full`` keeps everything, so it takes
        none."""
        return cls.of(name, None if name == "full" else budget, **settings)

    @property
    def name(self) -> str:
        return self.policy.name if isinstance(self.policy, Policy) else self.policy

    @property
    def bounded(self) -> bool:
        """Whether the cache holds at most a budget of tokens (not ``full``)."""
        return (self.policy.budget if isinstance(self.policy, Policy) else self.budget) is not None

    def build(self, input_length: int | None = None) -> Policy:
        """The policy, its fractional budget resolved against ``input_length``."""
        if isinstance(self.policy, Policy):
            return self.policy
        return make_policy(self.policy, self.budget, input_length, **self.options)

    def resolved(self, input_length: int | None = None) -> PolicySpec:
        """The same settings with the policy built (``build``): a fractional budget fixed to ``input_length``."""
        return PolicySpec(self.build(input_length), positions=self.positions, kv_bits=self.kv_bits)

    def fixed(self, longest: int | None) -> PolicySpec:
        """These settings with a fractional budget fixed to that share of ``longest`` tokens, the most a conversation
        may hold (a server gives every session one budget, so one compiled step's shape serves them all)."""
        if not isinstance(self.budget, float):
            return self
        if longest is None:
            raise ValueError(f"a fractional budget ({self.budget:g}) is a share of the most tokens a conversation may "
                             "hold: give --max-context TOKENS, or a budget in tokens")
        return replace(self, budget=resolve_budget(self.budget, longest))

    def cache(self, model: torch.nn.Module, input_length: int | None = None, **cache_options) -> EvictionCache:
        """An empty ``EvictionCache`` under these settings (``cache_options``: its others, e.g. ``chunk_size``)."""
        return EvictionCache(model, self.build(input_length), positions=self.positions, kv_bits=self.kv_bits,
                             **cache_options)

    def __str__(self) -> str:
        budget = "" if not isinstance(self.policy, str) or self.budget is None else f":{self.budget}"
        bits = getattr(self.kv_bits, "bits", self.kv_bits)  # (a KVQuantization's, or AS_COMPUTED)
        return f"{self.name}{budget}" + (f"+kv{bits}" if bits is not None else "")


def as_spec(policy: str | Policy | PolicySpec, budget: int | float | str | None = None) -> PolicySpec:
    """What the entry points take as ``policy`` (with ``budget`` beside a name) as one ``PolicySpec``."""
    if isinstance(policy, PolicySpec):
        if budget is not None:
            raise ValueError("the PolicySpec carries the budget: drop budget (or give the policy's name)")
        return policy
    return PolicySpec(policy, budget)
