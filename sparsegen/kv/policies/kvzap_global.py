from sparsegen.kv.policies.kvzap import KVzap
from sparsegen.kv.policy import register_policy


@register_policy
class KVzapGlobal(KVzap):
    """kvzap's learned scores under one budget for the whole model, as ``kvzip-global`` ranks KVzip's: every layer's
    and KV head's predicted log-scores compete for the model's ``budget × heads × layers`` slots (the scorer's
    per-layer intercept puts the layers on one scale), and each layer's heads share a pool sized by what they won. At
    the prefill's cost: no second reading of the context."""

    name = "kvzap-global"
    shares_slots = True
    budget_across_layers = True
