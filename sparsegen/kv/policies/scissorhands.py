from sparsegen.kv.policies.h2o import H2O


class Scissorhands(H2O):
    """Persistence of importance (Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
    LLM KV Cache Compression at Test Time", 2023): a token that drew more than the average attention (1/n over the n
    it competed with) from a query head is pivotal, and stays pivotal; keep the recent tokens and those pivotal most
    often. Counts run over every query so far (the paper's history window is the whole history here)."""

    name = "scissorhands"
    attention_statistic = "pivotal"
