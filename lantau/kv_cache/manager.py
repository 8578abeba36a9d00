"""Maps requests to KV blocks: allocate / append / free, with automatic prefix caching.

Block table of one request, block_size 4, 10 tokens of which 6 computed:

    tokens   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    blocks   |   block 7   |   block 2   |   block 9   |
    state    | full,hashed | partial     | not written |

A block is hashed (published to the prefix cache) in the step whose tokens fill it, because its
KV is written in that step before any later step can read it.
"""

from __future__ import annotations

from lantau.kv_cache.block_pool import Block, BlockPool, hash_block
from lantau.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[Block]] = {}
        # Chained hashes of each request's full blocks, computed once per block.
        self.req_to_hashes: dict[str, list[int]] = {}
        self.req_to_num_hashed: dict[str, int] = {}  # leading blocks already published
        # LoRA adapter name -> how many times an adapter of that name was unloaded: a name
        # loaded again is another adapter, whose blocks must not meet the old one's
        self.lora_epochs: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Hashes of the first `num_full_blocks` blocks of the request's tokens (a salted
        request's chain starts from its salt)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root(request)
            hashes.append(hash_block(parent, self._block_tokens(request, i)))
        return hashes[:num_full_blocks]

    def _block_tokens(self, request: Request, i: int) -> tuple:
        """Block i's tokens as its cache entry is checked (the salt with the first block's, so
        a hash collision across salts cannot be taken for a hit)."""
        tokens = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
        space = self._namespace(request) if i == 0 else None
        return tokens if space is None else (*space, *tokens)

    def _namespace(self, request: Request) -> tuple | None:
        """The request's own part of the cache, or None for the shared one: its LoRA adapter
        (an adapter's keys and values are not the base model's; one loaded again under a
        name is another: its epoch) and its cache salt."""
        params = request.sampling_params
        if params.cache_salt is None and params.lora is None:
            return None
        lora = None if params.lora is None else (params.lora, self.lora_epochs.get(params.lora, 0))
        return (lora, params.cache_salt)

    def _root(self, request: Request) -> int | None:
        """Where a request's chain of block hashes starts: its namespace's, or none."""
        space = self._namespace(request)
        return None if space is None else hash(("cache_salt", *space))

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of full blocks, and its token count.

        NOTE: at least one token is left to compute, since its logits are needed; and none is
        taken for a request asking for its prompt's logprobs (each position's logits are).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, block_hash in enumerate(self._block_hashes(request, max_blocks)):
            block = self.pool.lookup(block_hash, self._block_tokens(request, i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` beyond `request.num_computed_tokens`.

        `computed_blocks` (from get_computed_blocks, for a request with no blocks yet) are taken
        first; their tokens must already count in `num_computed_tokens`. Returns the ids of the
        blocks added to the request's table, or None, changing nothing, if too few are free.
        """
        if not computed_blocks:  # fast path of a running request whose blocks suffice
            blocks = self.req_to_blocks.get(request.request_id)
            num_total = request.num_computed_tokens + num_new_tokens
            if blocks is not None and num_total <= len(blocks) * self.block_size:
                self._publish_full_blocks(request, num_total)
                return []
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        assert not (blocks and computed_blocks), "computed blocks only for a new table"
        num_total = request.num_computed_tokens + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        for block in computed_blocks:
            self.pool.touch(block)
        new_blocks = [self.pool.allocate() for _ in range(max(num_needed, 0))]
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if request.request_id not in self.req_to_num_hashed:
            self.req_to_num_hashed[request.request_id] = len(computed_blocks)
        self._publish_full_blocks(request, num_total)
        return [b.block_id for b in computed_blocks + new_blocks]

    def _publish_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        # NOTE: a block whose last token is still pending (overlapped steps) is published by
        # a later call, once the token is known
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.req_to_num_hashed[request.request_id]
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i], self._block_tokens(request, i))
        self.req_to_num_hashed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; hashed ones stay reusable until evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # NOTE: the tail goes on the free list first so it is evicted before the shared head.
        for block in reversed(blocks):
            self.pool.free(block)
        self.req_to_hashes.pop(request.request_id, None)
        self.req_to_num_hashed.pop(request.request_id, None)

    def check_integrity(self) -> None:
        """Ref counts equal the number of request tables holding each block."""
        self.pool.check_integrity()
        expected = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "block twice in a table"
            for block in blocks:
                expected[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_count == expected[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {expected[block.block_id]} tables"
            )
