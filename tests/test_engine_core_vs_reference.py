"""The engine's KV-cache manager and scheduler make the reference's decisions, operation for operation."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis import given
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jax_engine.core.kv_cache_manager import CacheConfig, KVCacheManager
from jax_engine.core.scheduler import Scheduler
from jax_engine.sample.sampler import SampledToken
from jax_engine.sampling_params import SamplingParams
from reference import BlockManager
from reference import Request as ReferenceRequest
from reference import Scheduler as ReferenceScheduler
from tests.engine_helpers import sequence
from tests.strategies import prompts, scheduler_traces



class SameDecisions(RuleBasedStateMachine):
    """Apply each operation to both managers; every return value and every table must agree."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), num_host_blocks=st.integers(0, 8),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, num_host_blocks, caching):
        self.ref = BlockManager(num_blocks, block_size, num_host_blocks, caching)
        self.fast = KVCacheManager(num_blocks, block_size, num_host_blocks, caching)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0

    def _live(self, data, resident=True):
        seqs = [s for s in self.tokens if (s not in self.ref.swapped_out) == resident]
        return data.draw(st.sampled_from(seqs)) if seqs else None

    @rule(prompt=prompts, read_cache=st.booleans())
    def allocate(self, prompt, read_cache):
        """read_cache=False: a request asking for prompt logprobs (the engine marks it: skip_reading_cache)."""
        seq = f"s{self.next_id}"  # a fresh id per attempt: the engine never reuses a request id
        self.next_id += 1
        if not read_cache:
            self.fast.skip_reading_cache(seq)
        ok = self.ref.can_allocate(prompt, read_cache=read_cache)
        assert self.fast.can_allocate(seq, prompt) == ok
        if ok:
            assert self.fast.allocate(seq, prompt) == self.ref.allocate(seq, prompt, read_cache=read_cache)
            self.tokens[seq] = list(prompt)
            self.ref.cache_full_blocks(seq, prompt, len(prompt))
            self.fast.cache_full_blocks(seq, prompt, len(prompt))
        else:
            self.fast.forget(seq)  # given up, as an aborted waiting request is

    @rule(data=st.data(), token=st.integers(0, 2), num_new=st.integers(1, 3))
    def append(self, data, token, num_new):
        seq = self._live(data)
        if seq is None:
            return
        n = len(self.tokens[seq])
        ok = self.ref.can_append_slots(seq, n, num_new)
        assert self.fast.can_append_slots(seq, n, num_new) == ok
        if ok:
            assert self.fast.append_slots(seq, n, num_new) == self.ref.append_slots(seq, n, num_new)
            self.tokens[seq] += [token] * num_new
            self.ref.cache_full_blocks(seq, self.tokens[seq], len(self.tokens[seq]))
            self.fast.cache_full_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    @rule(data=st.data())
    def fork(self, data):
        parent = self._live(data)
        if parent is not None:
            child = f"s{self.next_id}"
            self.next_id += 1
            self.ref.fork(parent, child)
            self.fast.fork(parent, child)
            self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data())
    def free(self, data):
        seq = self._live(data) or self._live(data, resident=False)
        if seq is not None:
            self.ref.free(seq)
            self.fast.free(seq)
            self.fast.forget(seq)  # as the scheduler's finish does
            del self.tokens[seq]

    @rule(data=st.data())
    def swap_out(self, data):
        seq = self._live(data)
        if seq is not None and self.ref.can_swap_out([seq]):
            assert self.fast.can_swap_out([seq])
            assert self.fast.swap_out([seq]) == self.ref.swap_out([seq])

    @rule(data=st.data())
    def swap_in(self, data):
        seq = self._live(data, resident=False)
        if seq is not None:
            ok = self.ref.can_swap_in([seq])
            assert self.fast.can_swap_in([seq]) == ok
            if ok:
                assert self.fast.swap_in([seq]) == self.ref.swap_in([seq])

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        assert {s: self.ref.block_table(s) for s in self.ref.block_tables} == self.fast.block_tables
        for ref_pool, fast_pool in ((self.ref.device, self.fast.device), (self.ref.host, self.fast.host)):
            assert [b.ref_cnt for b in ref_pool.blocks] == fast_pool.ref_cnt
            assert list(ref_pool.free_queue) == list(fast_pool.free_queue)
        assert self.ref.swapped_out == self.fast.swapped_out
        assert self.ref.device.cached_blocks == self.fast.device.cached_blocks
        assert (self.ref.prefix_cache_hits, self.ref.prefix_cache_queries) == (
            self.fast.prefix_cache_hits, self.fast.prefix_cache_queries)
        # What the engine remembers per sequence (hashes, the uncached mark) goes when the sequence does.
        assert self.fast.tracked_seq_ids() <= self.tokens.keys()


TestSameDecisions = SameDecisions.TestCase


# ------------------------------------------------------------------------------- scheduler traces
def _engine_sequence(request_id, prompt, max_tokens, arrival, prompt_logprobs, priority=0):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return sequence(request_id, prompt, max_tokens, params, arrival, eos_token_ids=(99,), priority=priority)


def _sampled(token: int) -> SampledToken:
    return SampledToken(token, 0.0, 1, np.zeros(0, np.int32), np.zeros(0, np.float32))


@given(scheduler_traces(eos=99), st.lists(st.booleans(), min_size=8, max_size=8),
       st.lists(st.tuples(st.lists(st.sampled_from([0, 1, 99]), max_size=3), st.integers(0, 3)), min_size=1, max_size=6))
def test_engine_scheduler_decides_like_the_reference(trace, prompt_logprobs, speculation):
    """Under either scheduling policy (priorities drawn for "priority"), the same steps, preemptions and blocks.
    Request i asks for prompt logprobs when prompt_logprobs[i]: it computes every prompt token. With
    `speculation`, decoding requests take turns drafting tokens, of which the step accepts a prefix: lookahead
    slots, roll-back and trimming must match too."""
    config, blocks, requests, sampled = trace
    ref = ReferenceScheduler(config, BlockManager(**blocks))
    fast = Scheduler(config, CacheConfig(**blocks))
    fast_requests = {}
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    step = 0
    while pending or ref.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, priority) = pending.pop(0)
            request = ReferenceRequest(f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), i,
                                       priority, skip_reading_prefix_cache=prompt_logprobs[i])
            try:
                ref.add_request(request)
            except ValueError:
                continue  # the engine refuses the same requests before they reach its scheduler
            fast_requests[f"r{i}"] = _engine_sequence(f"r{i}", prompt, max_tokens, i, 1 if prompt_logprobs[i] else None,
                                                      priority)
            fast.add_request([fast_requests[f"r{i}"]])
        ref_out, fast_out = ref.schedule(), fast.schedule()
        assert [(s.seq.seq_id, s.num_new_tokens, s.block_table) for s in fast_out.scheduled] == [(s.request_id, s.num_new_tokens, s.block_table) for s in ref_out.scheduled]
        assert [p.seq.seq_id for p in fast_out.preempted] == ref_out.preempted
        assert (fast_out.swap_out, fast_out.swap_in, fast_out.copies) == (ref_out.swap_out, ref_out.swap_in, ref_out.copies)
        token, emitted = sampled[step % len(sampled)], {}
        for i, s in enumerate(ref_out.scheduled):  # each drafting request accepts its turn's count of drafts
            drafts = ref.requests[s.request_id].spec_token_ids
            accepted = speculation[(step + i) % len(speculation)][1] if drafts else 0
            emitted[s.request_id] = drafts[:accepted] + [token]
        fast_sampled = [(s.seq, _sampled(t)) for s in fast_out.scheduled for t in emitted[s.seq.seq_id]
                        if s.seq.num_computed_tokens + s.num_new_tokens >= s.seq.num_tokens]
        ref.update_from_output(ref_out, emitted, (99,))
        fast.update_from_output(fast_out, fast_sampled)
        for i, r in enumerate(ref.running):  # propose (an empty list drafts nothing), capped as the engines cap drafts
            if r.num_computed_tokens == r.num_tokens - 1:
                drafts = speculation[(step + i) % len(speculation)][0][: r.max_num_tokens - r.num_tokens - 1]
                r.spec_token_ids, fast_requests[r.request_id].spec_token_ids = list(drafts), list(drafts)
        assert fast.kv.block_tables == {r: ref.block_manager.block_table(r) for r in ref.block_manager.block_tables}
        assert [b.ref_cnt for b in ref.block_manager.host.blocks] == fast.kv.host.ref_cnt
        for request_id, r in fast_requests.items():
            assert (r.status, r.output_token_ids) == (ref.requests[request_id].status, ref.requests[request_id].output_token_ids)
        step += 1
        assert step < 2000
    assert not fast.has_unfinished_requests()
    assert not fast.kv.tracked_seq_ids()  # finished requests are forgotten


def test_trim_frees_the_tail_blocks_and_their_hashes():
    """Rolling back rejected tokens (speculative decoding): the table shrinks to the blocks the kept tokens
    need, the freed blocks return to the pool, and the sequence grows again from there."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    kv.allocate("s", tokens)
    kv.append_slots("s", 10, 5)  # 15 tokens' room: 4 blocks
    kv.cache_full_blocks("s", tokens + [7] * 5, 15)  # 3 full blocks hashed
    assert len(kv.block_tables["s"]) == 4 and len(kv.block_hashes["s"]) == 3
    kv.trim("s", 9)  # keep 9 tokens: 3 blocks, 2 of them full
    assert len(kv.block_tables["s"]) == 3 and len(kv.block_hashes["s"]) == 2
    assert kv.device.num_free_blocks == 5
    assert kv.num_blocks_to_append("s", 9, 7) == 1  # 16 tokens: the 4th block again
    kv.free("s")
    kv.forget("s")
    assert kv.device.num_free_blocks == 8 and not kv.tracked_seq_ids()


@pytest.mark.parametrize("budget, num_blocks, kept", [(16, 8, 4), (3, 8, 2), (16, 3, 0)],
                         ids=["all fit", "budget cuts", "no free block"])
def test_drafts_are_cut_to_the_token_budget_and_dropped_when_blocks_cannot_hold_them(budget, num_blocks, kept):
    """A decoding request's 4 drafts ride after its token as lookahead: as many as the step's token budget
    holds, and none when the free blocks cannot hold them (a draft never preempts). Both schedulers alike."""
    from reference import SchedulerConfig

    config = SchedulerConfig(max_num_seqs=1, max_model_len=24, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True)
    blocks = dict(num_blocks=num_blocks, block_size=4, num_host_blocks=0, enable_prefix_caching=False)
    ref, fast = ReferenceScheduler(config, BlockManager(**blocks)), Scheduler(config, CacheConfig(**blocks))
    # 8 prompt tokens and at most 4 more fit 3 blocks; after the first sampled token, drafts 2 to 4 would need a 4th
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    ref.add_request(ReferenceRequest("r", list(prompt), SamplingParams(temperature=0, max_tokens=4), 0))
    seq = _engine_sequence("r", prompt, 4, 0, None)
    fast.add_request([seq])
    while not seq.output_token_ids:  # prefill, in chunks where the budget is small
        ref_out, fast_out = ref.schedule(), fast.schedule()
        done = seq.num_computed_tokens + fast_out.scheduled[0].num_new_tokens >= seq.num_tokens
        ref.update_from_output(ref_out, {"r": [1]}, (99,))
        fast.update_from_output(fast_out, [(seq, _sampled(1))] if done else [])
    ref.requests["r"].spec_token_ids, seq.spec_token_ids = [2, 3, 4, 5], [2, 3, 4, 5]
    ref_out, fast_out = ref.schedule(), fast.schedule()
    assert ref_out.scheduled[0].num_new_tokens == fast_out.scheduled[0].num_new_tokens == 1 + kept
    assert ref.requests["r"].spec_token_ids == seq.spec_token_ids == [2, 3, 4, 5][:kept]
    assert fast.kv.block_tables == {"r": ref.block_manager.block_table("r")}
