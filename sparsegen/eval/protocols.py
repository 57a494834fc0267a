"""Compression protocols: how a long-context task feeds its prompt to a policy. They differ in what is encoded in
one pass before the policy first compresses, so in what its scores can see."""

PROTOCOLS = ("stream", "context", "context-once", "query-aware", "query-aware-once")


def check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def protocol_feed(protocol: str, prompt_tokens: int, context_tokens: int) -> dict:
    """``generate_tokens``'s ``first_chunk`` and ``hold_after_first`` for a prompt whose first ``context_tokens``
    are the context and the rest the question: ``stream`` feeds every chunk alike, evicting as it goes;
    ``context`` (kvpress's) encodes the context in one pass, compressed once, then the question; ``query-aware``
    encodes the whole prompt, question included, in one pass (the policy's scores see the question). A ``-once``
    protocol holds the cache after that first compression (nothing more is evicted: kvpress's decoding, whose cache
    grows by what comes after); the others hold the budget throughout."""
    check_protocol(protocol)
    first = None if protocol == "stream" else prompt_tokens if protocol.startswith("query-aware") else context_tokens
    return {"first_chunk": first, "hold_after_first": protocol.endswith("-once")}
