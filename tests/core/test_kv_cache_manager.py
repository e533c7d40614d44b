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


def test_blocks_after_a_twin_are_cached_after_the_block_it_duplicates():
    """A request that recomputes a block another request cached first (an identical prompt's last full block
    is never a hit) still caches what it computes after it, chained to the cached twin."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 18))  # two full blocks
    a = Request("a", prompt, SamplingParams(max_tokens=8))
    assert kv.allocate_slots(a, 8)
    b = Request("b", prompt, SamplingParams(max_tokens=8))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # the second block is computed again: a twin of a's
    assert kv.allocate_slots(b, 4, hits)
    b.num_computed_tokens = 8
    for t in (7, 7, 7, 7):
        b.append_token(t)
    assert kv.allocate_slots(b, 4)  # b's third block, after its twin
    b.num_computed_tokens = 12
    c = Request("c", prompt + [7, 7, 7, 7, 1], SamplingParams(max_tokens=1))
    assert kv.get_computed_blocks(c)[1] == 12
    kv.check_invariants()


def test_block_a_one_token_step_fills_is_a_hit_from_the_next_step_on():
    """Decode attention writes a one-token step's K/V and reads cached tokens in the same launch, unordered: a
    request admitted in that step must not read the block the token completes (it recomputes it), while blocks
    a longer step fills (written by their own kernel first) stay hits at once."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.begin_step()
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=8))
    assert kv.allocate_slots(a, 7)  # a prefill: its first block is a hit in the same step
    follower = Request("f", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    assert kv.get_computed_blocks(follower)[1] == 4
    a.num_computed_tokens = 7
    a.append_token(8)
    kv.begin_step()
    assert kv.allocate_slots(a, 1)  # decode token 8 completes a's second block
    assert kv.get_computed_blocks(follower)[1] == 4
    kv.begin_step()
    assert kv.get_computed_blocks(follower)[1] == 8
    kv.check_invariants()


def test_a_one_token_step_after_prefix_hits_keeps_them_hits():
    """A request that hits every full block of its prompt computes one token (n > 1 siblings: prompt length 1
    past a block boundary). Only a block that token completes waits for the next step; the hits it reused stay
    hits for the siblings admitted after it in the same step."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 19))  # two full blocks and one token
    computed(kv, "a", prompt)
    kv.begin_step()
    for i in range(3):
        sibling = Request(f"b#{i}", prompt, SamplingParams(max_tokens=4))
        hits, num_cached = kv.get_computed_blocks(sibling)
        assert num_cached == 8, i
        assert kv.allocate_slots(sibling, 1, hits)
    assert kv.num_free_blocks == 16 - 1 - 2 - 3  # the null block, the two shared, one tail each
    kv.check_invariants()
