"""Eviction policies by name: each module here registers one (``register_policy``); a policy of your own registers
itself the same way, in a file of its own, or from an installed package through the ``sparsegen.policies`` entry
point group."""

# imported for their registration, in the order the CLI lists them
from sparsegen.kv.policies import (  # noqa: F401
    ada_snapkv,
    adakv,
    expected_attention,
    full,
    h2o,
    keydiff,
    knorm,
    kvzap,
    kvzap_global,
    kvzip,
    kvzip_global,
    kvzip_heads,
    lagkv,
    pyramid,
    pyramid_snapkv,
    random,
    scissorhands,
    snapkv,
    snapkv_layers,
    streaming,
    streaming_h2o,
    tova,
    window,
)
from sparsegen.kv.policy import POLICIES, Policy, policy_options, register_policy
from sparsegen.plugins import from_entry_points

ENTRY_POINTS = "sparsegen.policies"


def policy_class(name: str) -> type[Policy]:
    """The registered policy called ``name`` (looking in installed packages' entry points if it is not yet)."""
    if name not in POLICIES and (found := from_entry_points(ENTRY_POINTS, name)) is not None:
        register_policy(found)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


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


def check_settings(name: str, budget: int | float | str | None = None,
                   options: dict | None = None) -> tuple[type[Policy], int | float | None, dict]:
    """``(class, budget, options)`` for a policy named with these settings, or the error naming the fix: an unknown
    name, a budget on ``full`` or none on the others, an option (None: the policy's default) it does not take."""
    cls = policy_class(name)
    given = {k: v for k, v in (options or {}).items() if v is not None}
    extra = [k for k in given if k not in policy_options(cls)]
    if extra:
        takes = ", ".join(f"--{k}" for k in policy_options(cls)) or "none"
        raise ValueError(f"policy {name!r} takes no --{' --'.join(extra)} (its options: {takes})")
    if name == "full":
        if budget is not None:
            raise ValueError("policy 'full' keeps everything and takes no budget")
        return cls, None, given
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget (tokens, or a fraction of the input length)")
    return cls, parse_budget(budget), given


def make_policy(name: str, budget: int | float | str | None = None, input_length: int | None = None,
                **options) -> Policy:
    """Build a policy by name; ``options`` (None: the policy's default) must be its constructor's own."""
    cls, budget, given = check_settings(name, budget, options)
    return cls(**given) if budget is None else cls(resolve_budget(budget, input_length), **given)
