"""Request.token_ids_range against its definition: prompt + output + a placeholder per pending
token, sliced, for every range of every split of a sequence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mmserve.params import SamplingParams
from mmserve.request import PLACEHOLDER, Request


@given(
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    output=st.lists(st.integers(0, 1000), max_size=12),
    pending=st.integers(0, 3),
    data=st.data(),
)
def test_token_ids_range_is_a_slice_of_the_whole(
    prompt: list[int], output: list[int], pending: int, data: st.DataObject
) -> None:
    request = Request("r", prompt, SamplingParams(), frozenset(), 64, output_token_ids=list(output))
    request.num_pending = pending
    whole = prompt + output + [PLACEHOLDER] * pending
    end = data.draw(st.integers(0, len(whole)))
    start = data.draw(st.integers(0, end))
    assert request.token_ids_range(start, end) == whole[start:end]
