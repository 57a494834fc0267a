from sparsegen.kv.policies.h2o import H2O
from sparsegen.kv.policy import register_policy


@register_policy
class StreamingH2O(H2O):
    """H2O with StreamingLLM's rolling positions, so it streams past the trained length."""

    name = "streaming-h2o"
    default_positions = "rolling"
