"""Text of a reply as its tokens arrive, at O(1) amortized cost per token.

Decoding the whole reply again for every new token costs O(n) per token (O(n^2) a reply). Decoding the new token
alone is wrong: a byte-level or byte-fallback tokenizer splits one character over several tokens, and a
SentencePiece tokenizer drops a word's leading space when the word starts the decoded text. So each step decodes a
short window of tokens twice, once without and once with the new ones, and takes the difference; text that ends in
an incomplete character (U+FFFD) is held back until the character completes (the method of TGI and vLLM).
"""

from __future__ import annotations

INCOMPLETE = "\ufffd"
MOST_HELD = 8  # tokens held back waiting for a character to complete; beyond, the bytes were never a character


class Detokenizer:
    """``add(token)`` returns the text the token completes ("" while it holds back an incomplete character);
    ``flush()`` returns what is held back at the end. Together they give ``tokenizer.decode(tokens)``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.length = 0  # characters in ``pieces``
        self._prefix = 0  # the window's first token: decoded for context only
        self._read = 0  # tokens whose text is in ``pieces``

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.tokens):
            return ""
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        held = len(self.tokens) - self._read
        if not final and held < MOST_HELD and (len(after) <= len(before) or after.endswith(INCOMPLETE)):
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        if piece:
            self.pieces.append(piece)
            self.length += len(piece)
        return piece

    def tail(self, chars: int) -> str:
        """The last ``chars`` characters of the text so far (costs ``chars``, not the text's length)."""
        taken, size = [], 0
        for piece in reversed(self.pieces):
            if size >= chars:
                break
            taken.append(piece)
            size += len(piece)
        joined = "".join(reversed(taken))
        return joined[len(joined) - min(chars, len(joined)):]

    @property
    def text(self) -> str:
        return "".join(self.pieces)
