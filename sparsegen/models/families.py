"""The model families sparsegen runs, by transformers' ``model_type``: what eviction, pruning and contextual sparsity
need to know of each. A family of your own is one ``register_family`` call in a file of its own
(``examples/custom_family.py``; ``sparsegen --plugin FILE ...``), or an installed package's ``sparsegen.families``
entry point (a ``Family``)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.plugins import from_entry_points

ENTRY_POINTS = "sparsegen.families"
GATED_MLP = (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")


@dataclass(frozen=True)
class Family:
    """A decoder-only family whose attention goes through transformers' attention interface (so eviction can take
    it over) and whose decoder holds its blocks in ``.layers``."""

    model_type: str
    # the linears of a block whose output rows are the MLP's neurons, and the linear whose input columns are
    mlp: tuple[tuple[str, ...], str] = GATED_MLP
    mlp_size: str = "intermediate_size"  # the config field of the MLP's width
    mlp_matrices: int = 3  # weight matrices of the MLP (gated: gate, up, down)
    separate_heads: bool = False  # q/k/v/o projections sized by head counts: KV groups can be removed or skipped


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if not isinstance(family, Family) or not family.model_type:
        raise TypeError("register_family takes a Family with a model_type")
    FAMILIES[family.model_type] = family
    return family


def family(model_type: str) -> Family:
    """The family of ``model_type`` (looking in installed packages' entry points if it is not registered yet)."""
    if model_type not in FAMILIES and (found := from_entry_points(ENTRY_POINTS, model_type)) is not None:
        register_family(found)
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported architecture {model_type!r}: sparsegen supports {', '.join(FAMILIES)} (add "
                         "one with sparsegen.models.register_family)")
    return FAMILIES[model_type]


for _family in (Family("llama", separate_heads=True), Family("mistral", separate_heads=True),
                Family("qwen2", separate_heads=True), Family("qwen3", separate_heads=True),
                Family("gemma3_text", separate_heads=True),
                Family("gpt_neox", (("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h"), mlp_matrices=2),
                Family("phi3", (("mlp.gate_up_proj",), "mlp.down_proj")),
                Family("opt", (("fc1",), "fc2"), mlp_size="ffn_dim", mlp_matrices=2)):
    register_family(_family)
