from sparsegen.kv.policy import Policy, TokenView, register_policy


@register_policy
class Window(Policy):
    """Keep the last ``budget`` tokens."""

    name = "window"

    def priority(self, view: TokenView):
        return view.index.float()

    def query_view(self):
        return 0, self.budget
