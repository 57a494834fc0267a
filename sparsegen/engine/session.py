"""What the scheduler serves: a conversation (``Session``: its cache, and its draft cache under speculation, living
across turns), a reply being produced (``Job``) with its ``Sampling`` settings, and what a reply streams back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparsegen.detokenize import Detokenizer
from sparsegen.engine.sampling import check_sampling
from sparsegen.kv import EvictionCache


@dataclass
class Sampling:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # return each reply token's log-probability and this many top alternatives
    ignore_eos: bool = False  # decode max_tokens even past an end-of-sequence token (fixed-length benchmarks)

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.seed)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MOST_LOGPROBS):
            raise ValueError(f"logprobs takes 0 to {MOST_LOGPROBS} alternatives per token, got {self.logprobs!r}")


MOST_LOGPROBS = 20  # OpenAI's own limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A reply token's log-probability under the model (before temperature and top-p) and the ``top`` most likely
    tokens at its place, as ``(token id, log-probability)``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Prepared:
    """A request's text, tokenized against what its session held: ``ids`` are the tokens of ``text`` past ``base``
    (the session's text it extends, or "" to start over)."""

    text: str
    base: str
    ids: list[int]
    several_messages: bool


class SessionsBusy(RuntimeError):
    """Every one of ``max_sessions`` sessions is answering a request: a new one must wait for one to finish."""


class Session:
    """One conversation: its cache, and the text that cache holds (plus ``pending``, the last reply token, fed with
    the next turn)."""

    def __init__(self, session_id: str | None, cache: EvictionCache, draft: EvictionCache | None = None):
        self.id, self.cache, self.draft = session_id, cache, draft
        self.context: str | None = None  # the compressed context it starts from (restored when it starts over)
        self.draft_lag: list[int] = []  # tokens in ``cache`` that the draft cache has not been fed yet
        self.text = ""
        self.pending: list[int] = []
        self.turns = 0
        self.busy = False
        self.idle_since = 0.0  # time.monotonic() when its last reply ended

    @property
    def kv_tokens(self) -> int:
        return max(self.cache.held_tokens(), default=0)

    def release(self) -> None:
        """Give the caches' memory back now (the session is dropped or starts over)."""
        for cache in (self.cache, self.draft):
            if cache is not None:
                cache.reset()


@dataclass
class Job:
    session: Session
    sampling: Sampling
    prompt_tokens: int  # tokens fed for this turn (the new text only, unless the history was re-encoded)
    reencoded: bool  # the session's history had to be encoded again (new, evicted, or the messages changed)
    strip_leading: bool  # a base model's reply starts with the space after "Assistant:": not part of the content
    generator: torch.Generator | None
    cached_tokens: int = 0  # the prompt's tokens before those, that the session's cache already stood for (evicted
    # to its budget or not) and so were not encoded again: OpenAI's ``usage.prompt_tokens_details.cached_tokens``
    on_text: Callable[[Job, str], None] | None = None
    text: Detokenizer | None = None  # the reply's raw text (a base model's template space included)
    stops: tuple[str, ...] = ()
    feed: list[int] = field(default_factory=list)  # prompt tokens not encoded yet
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per reply token, when the sampling asks
    shown: list[str] = field(default_factory=list)  # the reply as returned so far, in the pieces sent
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None
    cancelled: bool = False
    lead: int | None = None  # characters of the raw text before the reply (None: not known yet)
    searched: int = 0  # characters of the raw text already searched for stop strings
    emitted: int = 0  # characters of the raw text already shown (``lead`` included)
    served: int = 0  # the engine step that last encoded a chunk of its prompt (or began it)
    forget: int = 0  # reply tokens in the cache past a stop string: dropped when the row is back in its session

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def content(self) -> str:
        """The reply as returned: stop strings and what follows them removed."""
        return "".join(self.shown)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not shown until known)."""
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):  # only lengths that would hold back more
            if stop.startswith(text[-n:]):
                held = n
                break
    return held


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` (one row) and the ``top`` likeliest tokens'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    pairs = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), pairs)


def template_space(reply: str) -> int:
    """Characters at the start of a base model's reply that are the template's space after "Assistant:", not the
    reply: that space, unless more whitespace follows (the template renders a reply that starts with whitespace
    without adding one, and what a client sends back must render as the text the cache holds)."""
    return 1 if reply.startswith(" ") and not reply[1:2].isspace() else 0
