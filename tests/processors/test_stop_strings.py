from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.processors.stop_strings import StopStringMatcher


def reference(
    text: str, stops: Sequence[str], include: bool, quiet: int = 0
) -> tuple[str, str | None]:
    """Brute force: grow the text a character at a time until it ends with a stop string
    (the first listed, on a tie); none may end within the first `quiet` characters."""
    for end in range(quiet + 1, len(text) + 1):
        for stop in (s for s in stops if s):
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


def stream(
    chunks: Sequence[str], stops: Sequence[str], include: bool, quiet_chunks: int = 0
) -> tuple[str, str | None]:
    """The chunks through a matcher; the first `quiet_chunks` pushed with may_stop=False."""
    matcher = StopStringMatcher(stops, include)
    out, stopped_on = [], None
    for i, chunk in enumerate(chunks):
        delta, hit = matcher.push(chunk, may_stop=i >= quiet_chunks)
        out.append(delta)
        stopped_on = stopped_on or hit
    out.append(matcher.flush())
    assert stopped_on == matcher.stopped_on
    return "".join(out), stopped_on


def test_holds_back_a_possible_stop_until_disambiguated() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", None)
    assert matcher.push("O") == ("", None)
    assert matcher.push("RM") == ("STORM", None)
    assert matcher.push("x STO") == ("x ", None)
    assert matcher.push("P and more") == ("", "STOP")
    assert matcher.push("ignored") == ("", None)
    assert matcher.flush() == ""


def test_include_stop_string() -> None:
    assert stream(["Hello wor", "ld! Bye"], ["world"], include=True) == ("Hello world", "world")
    assert stream(["Hello wor", "ld! Bye"], ["world"], include=False) == ("Hello ", "world")


def test_stop_at_the_very_start() -> None:
    assert stream(["<e", "nd> rest"], ["<end>"], include=False) == ("", "<end>")


def test_the_stop_ending_first_wins_whatever_the_chunking() -> None:
    # "b" ends before "abc" does, so a char-by-char stream stops at "b"; one chunk must too.
    for chunks in (["abc"], ["a", "b", "c"], ["ab", "c"]):
        assert stream(chunks, ["abc", "b"], include=False) == ("a", "b")
    # Same end: the one listed first (vLLM's check_stop_strings ties).
    assert stream(["xabc"], ["bc", "abc"], include=True) == ("xabc", "bc")
    assert stream(["xabc"], ["bc", "abc"], include=False) == ("xa", "bc")
    assert stream(["xa", "bc"], ["abc", "bc"], include=False) == ("x", "abc")


def test_earliest_end_wins_whatever_the_list_order() -> None:
    # vLLM's test_check_stop_strings: " is a" arrives at once; "is" completes before " a".
    for stops in (["a", "is"], ["is", "a"]):
        assert stream([" The user", " is a"], stops, include=False) == (" The user ", "is")
        assert stream([" The user", " is a"], stops, include=True) == (" The user is", "is")


def test_no_stop_ends_in_quiet_text() -> None:
    # min_tokens: a stop string may not end in the text of the first tokens, but one that
    # begins there and ends later does stop the output, cut where it begins.
    assert stream(["the cat", " sat"], ["a"], include=False, quiet_chunks=1) == ("the cat s", "a")
    assert stream(["wait", "ing"], ["ting"], include=False, quiet_chunks=1) == ("wai", "ting")
    # a whole stop string held back in the quiet text (it might grow into a longer one)
    # does not match once stops are allowed
    assert stream(["xab", "c"], ["ab", "abcd"], include=False, quiet_chunks=1) == ("xabc", None)
    assert stream(["xab", "cd"], ["ab", "abcd"], include=True, quiet_chunks=1) == ("xabcd", "abcd")


def test_unmatched_prefix_is_released_at_flush() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42</ans") == ("42", None)
    assert matcher.flush() == "</ans"
    assert matcher.stopped_on is None


def test_no_stops_releases_everything() -> None:
    assert stream(["a", "b😀"], [], include=False) == ("ab😀", None)


# database=None: hypothesis must not write an example database into the repository.
alphabet = st.sampled_from("ab😀\n")
texts = st.text(alphabet, max_size=14)
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3)


@settings(max_examples=300, deadline=None, database=None)
@given(text=texts, stops=stop_lists, include=st.booleans(), data=st.data())
def test_random_chunking_matches_reference(
    text: str, stops: list[str], include: bool, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert stream(chunks, stops, include) == reference(text, stops, include)


@settings(max_examples=300, deadline=None, database=None)
@given(text=texts, stops=stop_lists, include=st.booleans(), data=st.data())
def test_quiet_prefix_matches_reference(
    text: str, stops: list[str], include: bool, data: st.DataObject
) -> None:
    quiet = data.draw(st.integers(0, len(text)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)) + [quiet])
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    expected = reference(text, stops, include, quiet)
    assert stream(chunks, stops, include, quiet_chunks=cuts.index(quiet) + 1) == expected


@settings(max_examples=100, deadline=None, database=None)
@given(text=texts, stops=stop_lists, include=st.booleans())
def test_every_split_point_and_char_by_char(text: str, stops: list[str], include: bool) -> None:
    expected = reference(text, stops, include)
    assert stream(list(text), stops, include) == expected
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], stops, include) == expected
