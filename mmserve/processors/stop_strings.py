"""Stop-string matching on streamed text, independent of how the text was chunked.

Contract: for any split of a text T into chunks, the concatenation of everything `push` and
`flush` release equals `T` cut at the first stop string, where "first" means the occurrence
that *ends* earliest (ties: the one listed first, as vLLM). That is the point at which a model
emitting T one character at a time would have been stopped, so the result never depends on
token boundaries. Text that could still grow into a stop string is held back until it cannot.
Text pushed with `may_stop=False` (min_tokens not reached) cannot end a stop string, though
one may begin in it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in a text arriving in chunks. One per output stream."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match before any text; SamplingParams.validate rejects them.
        self._stops = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        # Suffix of the text seen so far that is a proper prefix of some stop string.
        self._held = ""
        self.stopped_on: str | None = None  # the stop string matched, once one has

    def push(self, text: str, may_stop: bool = True) -> tuple[str, str | None]:
        """Add a chunk; return (text safe to release now, stop string matched by this chunk).
        may_stop False: no stop string may end in this chunk (vLLM's min_tokens).

        After a match the output is over: later pushes release nothing.
        """
        if self.stopped_on is not None:
            return "", None
        buf = self._held + text
        match = self._first_match(buf, len(self._held)) if may_stop else None
        if match is not None:
            end, stop = match
            self._held = ""
            self.stopped_on = stop
            return buf[: end if self._include else end - len(stop)], stop
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Release the held text: the stream has ended, so it can no longer become a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str, held: int) -> tuple[int, str] | None:
        # Only occurrences ending past the held text are new: the held text was searched when
        # it arrived, or arrived when no stop string could end in it. For one stop string the
        # occurrence that starts first also ends first; across stop strings compare end
        # positions (strictly: on a tie the one listed first wins).
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop, max(0, held - len(stop) + 1))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[0]:
                best = (end, stop)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
