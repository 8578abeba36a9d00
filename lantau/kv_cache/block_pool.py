"""A pool of fixed-size KV blocks with ref counts and a prefix-hash index (no torch).

A full block is keyed by a chained hash of its token ids (the parent block's hash folded in),
so equal hashes mean equal prefixes up to a hash collision; hits are verified against the
stored token ids. A freed block keeps its hash and stays reusable until it is evicted, least
recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: depends on every token before it too."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its KV written
    token_ids: tuple[int, ...] = ()  # the block's tokens, to verify a hash hit


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_prefix_caching = enable_prefix_caching
        # NOTE: insertion order is eviction order; the front is evicted first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block with this hash and these tokens, if any."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def touch(self, block: Block) -> None:
        """Take one more reference to a cached block (it may be on the free list)."""
        if block.ref_count == 0:
            del self.free_block_ids[block.block_id]
        block.ref_count += 1

    def allocate(self) -> Block:
        """A fresh block, evicting the least recently freed one (and its hash)."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list with refs"
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def free(self, block: Block) -> None:
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block.block_id] = None

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Publish a full block under its hash; the first writer of a hash keeps the entry."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.hash_to_block_id.setdefault(block_hash, block.block_id)

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all free blocks (blocks in use keep theirs); returns how
        many were forgotten. For benchmarks that must start cold, and after a weight swap."""
        dropped = 0
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            dropped += 1
        return dropped

    def check_integrity(self) -> None:
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in free), (
                f"block {block.block_id}: ref_count {block.ref_count}, on free list "
                f"{block.block_id in free}"
            )
        for block_hash, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale hash for {block_id}"
