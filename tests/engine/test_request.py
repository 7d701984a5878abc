"""A request's token slices equal slices of its joined prompt and output."""

from hypothesis import given
from hypothesis import strategies as st

import kvpool.engine as ke
from kvpool.engine.request import Request
from kvpool.engine.stream import RequestStream


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.lists(st.integers(0, 9), max_size=6),
       st.integers(-1, 14), st.integers(-1, 14))
def test_token_slice_is_a_slice_of_all_tokens(prompt, output, start, end):
    req = Request("r", prompt, ke.SamplingParams(), RequestStream("r"), None)
    req.output = output
    start, end = max(start, 0), max(end, 0)
    assert req.token_slice(start, end) == req.all_tokens[start:end]
