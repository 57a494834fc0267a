from sparsegen.kv.policies.kvzip_heads import KVzipHeads
from sparsegen.kv.policy import register_policy


@register_policy
class KVzipGlobal(KVzipHeads):
    """KVzip with one budget for the whole model, as kvpress's ``KVzipPress`` ranks: every layer's and KV head's
    reconstruction scores compete for the model's ``budget × heads × layers`` slots, so a layer whose second reading
    attends to many tokens (copying a book, it attends to every token once) takes the share of one that attends to
    few. Each layer's heads share one pool, sized by what they won (``budget_across_layers``): the memory is the
    budget's, where kvpress masks and keeps every token. After the compression each layer evicts within its own
    pool."""

    name = "kvzip-global"
    budget_across_layers = True
