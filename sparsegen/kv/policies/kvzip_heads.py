from sparsegen.kv.policies.kvzip import KVzip
from sparsegen.kv.policy import register_policy


@register_policy
class KVzipHeads(KVzip):
    """KVzip with its head budgets (the paper's non-uniform variant): a layer's KV heads share one pool of
    ``budget × heads`` slots (``shares_slots``) and the pairs with the highest reconstruction scores win it,
    whichever head they are in. A copying head, which attends to every token once as it copies, holds many; a head
    that attends to few holds few."""

    name = "kvzip-heads"
    shares_slots = True
