"""KV-cache eviction: policies that say which tokens to keep, and a cache that really drops the rest."""

from sparsegen.kv.attention import patched, prepare, release
from sparsegen.kv.cache import EvictionCache
from sparsegen.kv.policies import POLICIES, make_policy, resolve_budget
from sparsegen.kv.policy import Policy, TokenView, register_policy
from sparsegen.kv.quantized import KVQuantization
from sparsegen.kv.spec import PolicySpec

__all__ = ["POLICIES", "EvictionCache", "KVQuantization", "Policy", "PolicySpec", "TokenView", "make_policy",
           "patched", "prepare", "register_policy", "release", "resolve_budget"]
