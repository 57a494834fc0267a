from sparsegen.kv.policy import Policy, TokenView, register_policy

MULTIPLIER, SPAN = 2654435761, 1 << 24  # Knuth's multiplicative hash, kept within float32's exact integers


@register_policy
class Random(Policy):
    """The control every eviction policy should beat: keep a pseudo-random subset, each token's score a fixed hash
    of its position (the same in every layer and head, so runs repeat exactly)."""

    name = "random"

    def priority(self, view: TokenView):
        return ((view.index * MULTIPLIER) % SPAN).float()
