"""TokenBytes: a token list kept as packed uint32 bytes, read like the list."""
import pickle

import pytest

from engine.block_hash import block_hashes, packed_tokens
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.token_bytes import TokenBytes


def test_reads_like_the_list_it_packs():
    tokens = [3, 70000, 5, 0, 2 ** 32 - 1, 9]
    tb = TokenBytes(packed_tokens(tokens))
    assert len(tb) == 6 and tb == tokens and tokens == tb and tb == tuple(tokens)
    assert tb[1] == 70000 and tb[-1] == 9 and tb[1:4] == [70000, 5, 0] and list(tb) == tokens
    assert tb + [1] == tokens + [1] and [1] + tb == [1] + tokens
    assert tb != tokens[:-1] and tb != tokens[:-1] + [8] and tb == TokenBytes(packed_tokens(tokens))
    assert packed_tokens(tb) == tb.data
    assert block_hashes(tb, 2, "s") == block_hashes(tokens, 2, "s")
    assert pickle.loads(pickle.dumps(tb)) == tokens
    with pytest.raises(TypeError):
        hash(tb)


def test_a_request_takes_it_as_its_prompt():
    tokens = list(range(3, 40))
    r = Request("a", TokenBytes(packed_tokens(tokens)), SamplingParams(max_tokens=2))
    assert r.num_prompt_tokens == 37 and r.num_tokens == 37
    r.append_output_token(7)
    assert r.num_tokens == 38 and r.all_token_ids == tokens + [7]


def test_bad_bytes_say_how_to_make_them():
    with pytest.raises(ValueError, match="whole number of 4-byte tokens"):
        TokenBytes(b"\x01\x02\x03")
