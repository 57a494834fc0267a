from sparsegen.kv.policy import Policy, register_policy


@register_policy
class Full(Policy):
    """Keep everything: the model's own behaviour, the reference for exactness."""

    name = "full"

    def __init__(self):
        super().__init__(None)
