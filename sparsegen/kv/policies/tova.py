from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class TOVA(Policy):
    """Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024): keep the tokens the
    current query attends to most (summed over the KV head's query heads); nothing accumulates."""

    name = "tova"
    needs_attention = True
    attention_statistic = "latest"

    def priority(self, view: TokenView):
        return view.attention
