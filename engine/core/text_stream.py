"""Incremental detokenization and stop-string matching, sans I/O.

Fed the bytes each generated token contributes (its *piece*), a `TextStream`
returns the text that is now safe to show:

* never half a UTF-8 character: bytes are decoded incrementally (the standard
  library's incremental UTF-8 decoder, invalid bytes replaced by U+FFFD), so a
  character spread over several tokens appears once, whole;
* never text that a stop string will later cut: the longest suffix that could
  still be the start of a stop string is held back until it cannot be;
* stop strings are matched on the decoded text, across token boundaries. The
  first stop string to *complete* wins (among those completing on the same
  character, the one starting first); the text ends right before it, as in
  OpenAI's API, and nothing after it is ever shown.

The concatenation of everything returned is therefore `decode(all bytes)` cut
before the first stop string, however the bytes were split into pieces (the
property tests check exactly this against a one-line oracle).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


@dataclass(frozen=True, slots=True)
class TextStep:
    """What one feed released: `text` to show now, and whether a stop string matched."""

    text: str
    stopped: bool


_NOTHING = TextStep("", False)


class TextStream:
    """One request's output text: `feed(piece)` per token, `finish()` when generation ends for another reason."""

    __slots__ = ("stops", "stopped", "finished", "_decoder", "_held", "_max_hold", "_firsts", "plain", "decode",
                 "_unchecked")

    def __init__(self, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        """`min_tokens`: the stop strings end nothing until more tokens than this were fed (vLLM's rule)."""
        assert all(isinstance(s, str) and s for s in stops), "stop strings are non-empty str"
        self.stops = tuple(dict.fromkeys(stops))
        self.stopped = False  # a stop string matched: nothing more will be shown
        self.finished = False
        self._decoder = _Utf8Decoder("replace")
        # No stop strings: feed(piece).text is just the decoder's output, and `decode(piece)` gives it
        # without a TextStep per token (the scheduler's hot path; same state as feed).
        self.plain = not self.stops
        self.decode = self._decoder.decode
        self._held = ""  # decoded text that may be the start of a stop string
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._firsts = frozenset(s[0] for s in self.stops)
        self._unchecked = min_tokens if self.stops else 0  # tokens still to feed before a stop string may match

    def feed(self, piece: bytes) -> TextStep:
        """The bytes of one more token; returns the text now safe to show."""
        assert not self.stopped and not self.finished, "fed after the stream ended"
        new = self._decoder.decode(piece)
        if not self.stops:
            return TextStep(new, False) if new else _NOTHING
        if self._unchecked:
            self._unchecked -= 1
            return self._scan(self._held + new, final=False, match=False) if new else _NOTHING
        if not new:
            return _NOTHING
        return self._scan(self._held + new, final=False)

    def finish(self) -> TextStep:
        """Generation ended (EOS, length, stop token): flush an incomplete character (as U+FFFD) and the held text."""
        if self.stopped or self.finished:
            return _NOTHING
        self.finished = True
        buf = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        if not self.stops:
            return TextStep(buf, False) if buf else _NOTHING
        return self._scan(buf, final=True)

    def prime(self, pieces: Iterable[bytes]) -> bool:
        """Replay tokens already shown elsewhere (a resumed stream's continuation), discarding their text.

        The state afterwards is the one the original server had, so held text
        and half characters carry over. Returns True when a stop string
        already matched inside them.
        """
        for p in pieces:
            if self.feed(p).stopped:
                return True
        return False

    def _scan(self, buf: str, final: bool, match: bool = True) -> TextStep:
        best: tuple[int, int] | None = None  # (end, start) of the first stop string to complete
        for s in self.stops if match else ():
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        if best is not None:
            self.stopped = True
            self._held = ""
            return TextStep(buf[:best[1]], True)
        keep = 0 if final else self._hold_len(buf)
        if keep:
            self._held = buf[-keep:]
            buf = buf[:-keep]
        else:
            self._held = ""
        return TextStep(buf, False) if buf else _NOTHING

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        n = len(buf)
        for k in range(min(n, self._max_hold), 0, -1):
            if buf[n - k] in self._firsts:
                tail = buf[n - k:]
                for s in self.stops:
                    if len(s) > k and s.startswith(tail):
                        return k
        return 0

