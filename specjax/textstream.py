"""A completion's text as its tokens arrive: incremental detokenization with stop strings.

The text is always the text of all the tokens so far (special tokens skipped, as
OpenAI-compatible servers return them), built without decoding them all again on each
update: the text up to the last point where it was whole (no trailing U+FFFD, so its
bytes end on a character boundary) is kept, and only the tokens after it are decoded, with
a few before them for context (a decoder may render a token's leading space by what comes
before it). Decoding a byte-level BPE sequence (Qwen3's tokenizer) is then the same as
decoding all of it, and an update costs the new tokens, not the whole text.

Two things are held back until more tokens settle them: a trailing U+FFFD (a multi-byte
character whose bytes are split across tokens), with any start of a stop string just
before it (the character it becomes may continue it), and a tail that could be the start
of a stop string. The earliest stop string found ends the text before it, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT = 4  # tokens decoded before the new ones, to render the first new one as in the whole text


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
        self.stop: str | None = None  # which (the earliest in the text)
        self.tokens_used = 0       # tokens the text comes from (up to the one completing the stop string)
        self._whole = 0            # leading tokens whose text is whole (ends on a character boundary)
        self._whole_text = ""      # their text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def _text(self, end: int) -> str:
        """The text of the first `end` tokens (at least the whole ones): the whole text kept,
        then the tokens after it decoded with CONTEXT tokens before them, less the text of
        those."""
        start = max(0, self._whole - CONTEXT)
        context = self._decode(self.ids[start:self._whole])
        return self._whole_text + self._decode(self.ids[start:end])[len(context):]

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take newly committed tokens; return the text that is now safe to send (all of the
        rest when `final`: generation is over). Once a stop string is found, `stopped` is
        set and later tokens change nothing."""
        if self.stopped:
            return ""
        self.ids += tokens
        self.tokens_used = len(self.ids)
        text = self._text(len(self.ids))
        found = [(i, len(s), s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:
            cut, length, self.stop = min(found)
            self.tokens_used = self._tokens_to(text[:cut + length])
            self.stopped, final, text = True, True, text[:cut]
        elif not text.endswith(REPLACEMENT):
            self._whole, self._whole_text = len(self.ids), text
        ready = len(text) if final else len(text) - self._unsettled(text)
        if ready <= len(self.sent):
            return ""
        new = text[len(self.sent):ready]
        self.sent = text[:ready]
        return new

    def _unsettled(self, text: str) -> int:
        """Characters at the end of `text` that later tokens may still change: a trailing
        U+FFFD run and the start of a stop string before it, or a start of a stop string
        ending the text."""
        split = len(text) - len(text.rstrip(REPLACEMENT))
        before = text[:len(text) - split]
        held = split
        for stop in self.stops:
            held = max(held, _stop_start(text, stop), split + _stop_start(before, stop))
        return held

    def _tokens_to(self, through: str) -> int:
        """The fewest leading tokens whose text starts with `through` (the text up to the end
        of the first stop string found): the completion's token count. The whole text kept
        has no stop string in it, so they are more than its tokens."""
        low, high = self._whole + 1, len(self.ids)
        while low < high:
            mid = (low + high) // 2
            if self._text(mid).startswith(through):
                high = mid
            else:
                low = mid + 1
        return low


def _stop_start(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with (0 if none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
