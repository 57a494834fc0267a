from sparsegen.kv.policy import Policy, TokenView, register_policy

RESOLUTION = 2**-10  # norms closer than this tie (ties keep the newer token): rotation noise never decides


@register_policy
class Knorm(Policy):
    """Keep the keys of smallest L2 norm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression", 2024): low-norm keys draw high attention. A rotation keeps a norm, so it holds under rolling
    positions too; norms are compared at a fixed resolution, so the same token repeated is a tie."""

    name = "knorm"
    needs_keys = True

    def priority(self, view: TokenView):
        return -(view.keys.float().norm(dim=-1) / RESOLUTION).round()
