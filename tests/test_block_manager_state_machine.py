"""A Hypothesis state machine drives the reference block manager and checks its invariants.

The machine stores, for every physical slot, the token whose K/V it holds: "computing" a token writes it
into its slot. That makes the memory-safety promises checkable: copy-on-write never writes a shared block,
and a prefix-cache hit only ever hands out blocks holding exactly the request's tokens.
"""

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from reference import BlockManager

tokens = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # a tiny alphabet makes prefixes collide


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), num_host_blocks=st.integers(0, 8),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, num_host_blocks, caching):
        self.bm = BlockManager(num_blocks, block_size, num_host_blocks, caching)
        self.tokens: dict[str, list[int]] = {}  # every live sequence's computed tokens
        self.device_slots: dict[int, int] = {}  # slot -> token stored there
        self.host_slots: dict[int, int] = {}
        self.next_id = 0

    # ------------------------------------------------------------------------------ helpers
    def _slot(self, seq: str, position: int) -> int:
        bs = self.bm.block_size
        return self.bm.block_table(seq)[position // bs] * bs + position % bs

    def _compute(self, seq: str, first: int) -> None:
        """Write tokens[first:] into their slots, checking no shared block is written."""
        for position in range(first, len(self.tokens[seq])):
            block = self.bm.block_tables[seq][position // self.bm.block_size]
            assert block.ref_cnt == 1, f"write into block {block.block_id} shared by {block.ref_cnt}"
            self.device_slots[self._slot(seq, position)] = self.tokens[seq][position]
        self.bm.cache_full_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    def _copy_blocks(self, mapping, src_slots, dst_slots):
        bs = self.bm.block_size
        for src, dst in mapping:
            for offset in range(bs):
                if src * bs + offset in src_slots:
                    dst_slots[dst * bs + offset] = src_slots[src * bs + offset]
                else:
                    dst_slots.pop(dst * bs + offset, None)

    def _resident(self):
        return [s for s in self.tokens if s not in self.bm.swapped_out]

    # -------------------------------------------------------------------------------- rules
    @rule(target=seqs, prompt=tokens)
    def allocate(self, prompt):
        if not self.bm.can_allocate(prompt):
            return None
        seq = f"s{self.next_id}"
        self.next_id += 1
        num_cached = self.bm.allocate(seq, prompt)
        self.tokens[seq] = list(prompt)
        assert num_cached % self.bm.block_size == 0 and num_cached < len(prompt)
        for position in range(num_cached):  # a prefix-cache hit implies identical tokens
            assert self.device_slots[self._slot(seq, position)] == prompt[position]
        self._compute(seq, num_cached)
        return seq

    @rule(seq=seqs, token=st.integers(0, 2))
    def append(self, seq, token):
        if seq not in self.tokens or seq in self.bm.swapped_out:
            return
        n = len(self.tokens[seq])
        if not self.bm.can_append_slots(seq, n, 1):
            return
        self._copy_blocks(self.bm.append_slots(seq, n, 1), self.device_slots, self.device_slots)
        self.tokens[seq].append(token)
        self._compute(seq, n)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or parent in self.bm.swapped_out:
            return None
        child = f"s{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.bm.free(seq)
            del self.tokens[seq]

    @rule(seq=seqs)
    def swap_out(self, seq):
        if seq in self.tokens and seq not in self.bm.swapped_out and self.bm.can_swap_out([seq]):
            mapping = self.bm.swap_out([seq])
            self._copy_blocks(mapping.items(), self.device_slots, self.host_slots)

    @rule(seq=seqs)
    def swap_in(self, seq):
        if seq in self.bm.swapped_out and self.bm.can_swap_in([seq]):
            mapping = self.bm.swap_in([seq])
            self._copy_blocks(mapping.items(), self.host_slots, self.device_slots)

    # --------------------------------------------------------------------------- invariants
    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self._resident():
            assert [self.device_slots[self._slot(seq, p)] for p in range(len(self.tokens[seq]))] == self.tokens[seq]

    @invariant()
    def free_plus_used_is_total_and_ref_counts_match_holders(self):
        for pool, seqs in ((self.bm.device, self._resident()), (self.bm.host, list(self.bm.swapped_out))):
            holders = [0] * pool.num_blocks
            for seq in seqs:
                for block in self.bm.block_tables[seq]:
                    holders[block.block_id] += 1
            assert [b.ref_cnt for b in pool.blocks] == holders
            assert pool.num_free_blocks + sum(h > 0 for h in holders) == pool.num_blocks
            for block in pool.blocks:  # no block both free and referenced
                assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)

    @invariant()
    def prefix_index_points_at_its_blocks(self):
        for block_hash, block_id in self.bm.device.cached_blocks.items():
            assert self.bm.device.blocks[block_id].block_hash == block_hash

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        for pool in (self.bm.device, self.bm.host):
            assert pool.num_free_blocks == pool.num_blocks
            assert all(b.ref_cnt == 0 for b in pool.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
