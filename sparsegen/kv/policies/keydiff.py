import torch.nn.functional as F

from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class KeyDiff(Policy):
    """Keep the keys least like the others (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-
    Context LLM Inference in Resource-Constrained Environments", 2025): score = minus the cosine similarity of each
    held key to the mean of the held keys' directions, per KV head. Keys as stored: rotated at their position."""

    name = "keydiff"
    needs_keys = True

    def priority(self, view: TokenView):
        directions = F.normalize(view.keys.float(), dim=-1) * view.valid[..., None]
        anchor = F.normalize(directions.sum(2, keepdim=True), dim=-1)
        return -(directions * anchor).sum(-1)
