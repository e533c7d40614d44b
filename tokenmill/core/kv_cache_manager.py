"""Block pool and per-request block tables for the paged KV cache, with prefix caching.

Block 0 is a reserved null block (padding in block tables); it is never handed out.
A block is *free* (ref_cnt 0, in the free queue, maybe still holding a reusable hash) or *in use*
(ref_cnt >= 1, owned by that many requests). The free queue is the LRU list: blocks are taken from its
front, and a cached block is evicted (its hash dropped) only when taken. Full blocks are identified by
a chained hash of (parent hash, token ids); a hit is confirmed without trusting the hash: the block's token ids
must match, and so must its parent, named by the unique id of the caching of the block before it (so a hash
collision anywhere in the chain cannot splice two prefixes together). A request that computes a block already
cached by another (a twin) chains its next blocks after that cached one.
Only full blocks are ever shared, and a full block is never written again, so sharing needs no copy:
the partial last block of each request is always its own.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    cache_id: int | None = None         # unique per caching of this block; None while it holds no hash
    parent_cache_id: int | None = None  # cache_id of the previous block of the prefix when this one was cached


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, KVCacheBlock] = {}
        self._cache_ids = itertools.count()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-used and cached-but-unreferenced)."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash, block.token_ids, block.cache_id = None, None, None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the LRU tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: KVCacheBlock | None) -> KVCacheBlock | None:
        """The cached block holding token_ids right after parent (the previous hit; None for a first block)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        if block.parent_cache_id != (None if parent is None else parent.cache_id):
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...],
                    parent: KVCacheBlock | None) -> KVCacheBlock | None:
        """Register block as holding token_ids after parent; the cached block that now stands for them: this
        one, one already cached (a hit, or a twin another request computed first), or None when the hash is
        taken by other content (a collision: the chain stops there)."""
        if block.block_hash is not None:
            return block
        cached = self.cached.get(block_hash)
        if cached is not None:
            return cached if cached is self.lookup(block_hash, token_ids, parent) else None
        block.block_hash, block.token_ids, block.cache_id = block_hash, token_ids, next(self._cache_ids)
        block.parent_cache_id = None if parent is None else parent.cache_id
        self.cached[block_hash] = block
        return block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # per request: the cached block its next full block follows, and that block's cache_id at the time (a
        # twin held by another request may be evicted and cached anew meanwhile: then the chain stops)
        self.chain_tail: dict[str, tuple[KVCacheBlock, int]] = {}
        self.prefix_queries = 0   # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0      # of which found
        # blocks that a one-token step fills in the step being scheduled: not a prefix hit before the next step,
        # since decode attention writes the step's token and reads cached tokens in one launch (unordered)
        self._filled_by_one_token: set[int] = set()

    def begin_step(self) -> None:
        """A new scheduling pass: blocks filled by the previous step's tokens are written by now."""
        self._filled_by_one_token.clear()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests."""
        return 1.0 - self.pool.num_free_blocks / self.usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(request.all_token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request (at most num_tokens - 1 tokens: the last token is
        always computed, so there are logits to sample from; nor past the prompt logprobs still owed, whose
        logits must be computed)."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if (owed := request.prompt_logprobs_from) is not None:
            max_blocks = min(max_blocks, owed // bs)
        hashes = self._block_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]),
                                     hits[-1] if hits else None)
            if block is None or block.block_id in self._filled_by_one_token:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens (after any prefix-cache hits). False if the pool is
        short; then nothing changes."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(new_computed_blocks)
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total, one_token=num_new_tokens == 1)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int,
                           one_token: bool = False) -> None:
        """Register blocks that will be full once this step's tokens are written. Safe because a
        scheduled request is never unscheduled within its step, and a step's K/V are written before attention
        reads them: by a kernel of their own, or, for a step of one token a sequence, inside the attention
        launch, so a block a one-token step fills is no hit until the next step (begin_step)."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_tokens, request.num_known_tokens) // self.block_size  # a pending token is hashed later
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        bs = self.block_size
        self.num_cached_blocks[request.request_id] = num_full
        parent = None
        if start:
            tail = self.chain_tail.pop(request.request_id, None)
            if tail is None or tail[0].cache_id != tail[1]:
                return
            parent = tail[0]
        for i in range(start, num_full):
            fresh = blocks[i].block_hash is None  # registered now, not a hit or a block hashed in an earlier step
            parent = self.pool.cache_block(blocks[i], hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]),
                                           parent)
            if parent is None:
                return
            if one_token and fresh and parent is blocks[i]:
                self._filled_by_one_token.add(parent.block_id)
        self.chain_tail[request.request_id] = (parent, parent.cache_id)

    def reserve_slots(self, request: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Grow a running request's table to hold num_tokens tokens without registering any hash: the draft
        model writes K/V of tokens the target has not computed yet there. False, and no change, unless
        keep_free blocks stay free."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return False
        need = self.blocks_needed(num_tokens) - len(blocks)
        if need > 0 and need > self.pool.num_free_blocks - keep_free:
            return False
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first num_tokens tokens (slots of rejected draft tokens). They
        were never registered: only blocks full of confirmed tokens get a hash."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks is not None and len(blocks) > keep:
            self.pool.free_blocks(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks first into the LRU so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.chain_tail.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> None:
        for block in self.pool.free_queue.values():
            block.block_hash, block.token_ids, block.cache_id = None, None, None
        self.pool.cached = {h: b for h, b in self.pool.cached.items() if b.ref_cnt > 0}

    def check_invariants(self) -> None:
        """free + in use == usable blocks; ref counts equal the number of tables holding each block."""
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
        in_use = 0
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != {refs[b.block_id]} tables"
            in_queue = b.block_id in self.pool.free_queue
            assert in_queue == (b.ref_cnt == 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue {in_queue}"
            in_use += b.ref_cnt > 0
        assert self.pool.num_free_blocks + in_use == self.usable_blocks
        for h, b in self.pool.cached.items():
            assert b.block_hash == h and b.cache_id is not None
