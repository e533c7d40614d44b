"""Prefix-cache hits never trust the hash: token ids and the parent block are both confirmed."""
import pytest

import tokenmill.core.kv_cache_manager as kv_cache_manager
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def computed(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """A request whose prompt was computed (its full blocks registered), then finished."""
    req = Request(request_id, tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(tokens))
    kv.free(req)


@pytest.fixture
def colliding_hash(monkeypatch):
    """A hash that ignores the parent: equal blocks under different prefixes collide."""
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, token_ids: hash(token_ids))


def test_hash_collision_under_another_prefix_is_not_a_hit(colliding_hash):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    computed(kv, "x", [1] * 4 + [9] * 4 + [5])   # caches [1111] then [9999] after it
    computed(kv, "y", [2] * 4 + [7])             # caches [2222]
    blocks, num_hit = kv.get_computed_blocks(Request("b", [2] * 4 + [9] * 4 + [5], SamplingParams(max_tokens=1)))
    assert num_hit == 4  # [2222] only: the cached [9999] was computed after [1111], not after [2222]
    same, num_same = kv.get_computed_blocks(Request("a", [1] * 4 + [9] * 4 + [5], SamplingParams(max_tokens=1)))
    assert num_same == 8 and [b.block_id for b in same[:1]] != [b.block_id for b in blocks]


def test_hash_collision_with_other_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, token_ids: 42)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    computed(kv, "x", [1] * 4 + [5])
    assert kv.get_computed_blocks(Request("b", [3] * 4 + [5], SamplingParams(max_tokens=1)))[1] == 0
    assert kv.get_computed_blocks(Request("a", [1] * 4 + [5], SamplingParams(max_tokens=1)))[1] == 4
