"""KV cache manager: allocation, ref counts, prefix caching with verified hits, LRU eviction."""

from __future__ import annotations

import pytest

from lantau.errors import InvalidRequestError
from lantau.kv_cache import block_pool
from lantau.kv_cache.manager import KVCacheManager
from lantau.request import Request, SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> int:
    """Schedule a whole prompt as the scheduler does; returns the cached token count."""
    blocks, num_cached = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_cached
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_allocate_append_free():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10)))  # 3 blocks
    assert admit(kv, req) == 0
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    for t in range(2):  # decode: 10 -> 12 tokens stays in 3 blocks
        req.append_output_token(100 + t)
        assert kv.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    req.append_output_token(102)
    assert len(kv.allocate_slots(req, 1)) == 1  # token 13 opens a 4th block
    kv.check_integrity()
    kv.free(req)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(12)))  # needs 3 blocks
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []
    kv.check_integrity()


def test_prefix_hit_computes_only_the_rest():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(3 * BS))  # a 3-block shared prefix
    a = make_request("a", prefix + [90, 91])
    b = make_request("b", prefix + [80, 81, 82])
    assert admit(kv, a) == 0
    assert admit(kv, b) == 3 * BS
    assert kv.block_ids("a")[:3] == kv.block_ids("b")[:3]
    assert kv.block_ids("a")[3] != kv.block_ids("b")[3]
    assert all(kv.pool.blocks[i].ref_count == 2 for i in kv.block_ids("a")[:3])
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_freed_blocks_stay_reusable_and_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(4 * BS + 1)))  # 4 full blocks + 1 token
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    # a newcomer with a different prompt takes 2 fresh blocks, then 2 evicted ones: the
    # never-used blocks go first, then a's tail, so a's first two blocks survive.
    other = make_request("o", [7] * (4 * BS))
    admit(kv, other)
    again = make_request("c", list(range(4 * BS + 1)))
    kv.free(other)
    blocks, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 2 * BS
    kv.check_integrity()


def test_at_least_one_token_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(2 * BS)))
    admit(kv, a)
    b = make_request("b", list(range(2 * BS)))  # identical, block-aligned prompt
    assert admit(kv, b) == BS  # the last block is recomputed so its logits exist


def test_hash_hits_are_verified(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, tokens: 42)
    import lantau.kv_cache.manager as manager

    monkeypatch.setattr(manager, "hash_block", lambda parent, tokens: 42)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    # same (colliding) hash, other tokens: must not be served from the cache
    assert admit(kv, make_request("b", [9, 9, 9, 9, 5])) == 0
    kv.check_integrity()


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(9))))
    assert admit(kv, make_request("b", list(range(9)))) == 0
    assert kv.pool.hash_to_block_id == {}


def test_double_free_is_caught():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    block = kv.req_to_blocks["a"][0]
    kv.free(a)
    with pytest.raises(AssertionError, match="double free"):
        kv.pool.free(block)


def test_cache_salt_keeps_prefixes_apart(monkeypatch):
    """Requests share cached prefixes only with the same salt (vLLM's cache_salt): another
    salt or none misses, the same salt hits; even if every block hashed alike, no salted
    request takes another's block (each entry's check holds the salt)."""
    tokens = list(range(13))  # 3 full blocks before the last token

    def cached(kv: KVCacheManager, request_id: str, salt: str | None) -> int:
        request = Request(request_id, tokens, SamplingParams(cache_salt=salt))
        num = admit(kv, request)
        kv.free(request)
        return num

    kv = KVCacheManager(num_blocks=32, block_size=BS)
    assert cached(kv, "a", None) == 0
    assert cached(kv, "b", "tenant-1") == 0  # a prefix unsalted requests cached: not its
    assert cached(kv, "c", "tenant-1") == 12  # its own
    assert cached(kv, "d", "tenant-2") == 0
    assert cached(kv, "e", None) == 12  # the unsalted entries stay
    kv.check_integrity()

    monkeypatch.setattr("lantau.kv_cache.manager.hash_block", lambda parent, t: 0)
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    assert cached(kv, "a", "tenant-1") == 0  # its first block holds the one hash
    assert [cached(kv, r, s) for r, s in (("b", None), ("c", "tenant-2"))] == [0, 0]
    assert cached(kv, "d", "tenant-1") == 4  # the salt's own block (the next ones collide)
    kv.check_integrity()
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")
