"""A completion's text as its tokens arrive: incremental detokenization with stop strings.

Each update decodes every token so far (special tokens skipped, as OpenAI-compatible
servers return them), so the text sent is always a prefix of the text of all the tokens.
Two things are held back until more tokens settle them: a trailing U+FFFD (a multi-byte
character whose bytes are split across tokens) and a tail that could be the start of a
stop string. The earliest stop string found ends the text before it, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """One choice's text. `tokenizer` decodes ids (a transformers tokenizer); `stop_ids`
    are the ids that end generation (left out of the text: the engine keeps the stop id as
    the last token); `stops` are the stop strings."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), stop_ids: Iterable[int] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer, self.stops, self.stop_ids = tokenizer, tuple(stops), frozenset(stop_ids)
        self.ids: list[int] = []   # every token received, stop ids included
        self.sent = ""             # the text handed out so far
        self.stopped = False       # a stop string was found: the text is final
        self.tokens_used = 0       # tokens the text comes from (up to the one completing the stop string)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take newly committed tokens; return the text that is now safe to send (all of the
        rest when `final`: generation is over). Once a stop string is found, `stopped` is
        set and later tokens change nothing."""
        if self.stopped:
            return ""
        self.ids += tokens
        self.tokens_used = len(self.ids)
        text = self._decode(self.ids)
        found = [(i, len(s)) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:
            cut, length = min(found)
            self.stopped, final, text = True, True, text[:cut]
            self.tokens_used = self._tokens_to(cut + length)
        ready = len(text) if final else len(text) - self._unsettled(text)
        if ready <= len(self.sent):
            return ""
        new = text[len(self.sent):ready]
        self.sent = text[:ready]
        return new

    def _unsettled(self, text: str) -> int:
        """Characters at the end of `text` that later tokens may still change."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _tokens_to(self, end: int) -> int:
        """The fewest leading tokens whose text is `end` characters long (the first stop
        string found ends there): the completion's token count."""
        low, high = 1, len(self.ids)
        while low < high:
            mid = (low + high) // 2
            if len(self._decode(self.ids[:mid])) >= end:
                high = mid
            else:
                low = mid + 1
        return low
