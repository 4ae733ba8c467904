"""Speculative decoding in the oracle's serving loop (issue 44): drafts are scheduled as lookahead slots, verified
in one forward pass, and rolled back when rejected.

Two checks: greedy output with a proposer equals greedy output without one, token for token, under preemption,
chunked prefill and prefix caching; and a Hypothesis state machine drives the scheduler and block manager with
random drafts and random acceptances, preemption and aborts, and checks that no block leaks or is freed twice,
that rejected drafts leave no blocks behind, and that only verified tokens enter the prefix cache.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from reference import BlockManager, LlamaModel, SamplingParams, Scheduler, SchedulerConfig
from reference.block_pool import hash_block_tokens
from reference.request import Request
from reference.speculative import DraftModelProposer, NgramProposer
from tests.test_reference_engine import make_engine, outputs

EOS = 2
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Repetitive prompts over a tiny alphabet: the n-gram proposer finds matches and the tiny model repeats itself.
repetitive_prompts = st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=10), min_size=1, max_size=3)


def other_model(checkpoint, seed: int) -> LlamaModel:
    """The checkpoint's shapes with other random weights: a draft that disagrees with the target."""
    rng = np.random.default_rng(seed)
    weights = {name: (w + rng.normal(scale=0.5, size=w.shape)).astype(np.float32) for name, w in checkpoint.weights.items()}
    return LlamaModel(checkpoint.config, weights)


@settings(max_examples=30)
@given(
    prompts=repetitive_prompts,
    method=st.sampled_from(["ngram", "draft is the target", "draft disagrees"]),
    k=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 8),
    chunked=st.booleans(),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_greedy_speculative_output_equals_greedy_output(tiny_checkpoint, prompts, method, k, block_size, spare_blocks,
                                                        chunked, caching, mode):
    baseline = outputs(make_engine(tiny_checkpoint, max_model_len=32, max_num_batched_tokens=32), prompts, GREEDY)
    proposer = {"ngram": lambda: NgramProposer(k, prompt_lookup_min=1, prompt_lookup_max=3),
                "draft is the target": lambda: DraftModelProposer(LlamaModel(tiny_checkpoint.config,
                                                                             tiny_checkpoint.weights), k),
                "draft disagrees": lambda: DraftModelProposer(other_model(tiny_checkpoint, 1), k)}[method]()
    num_blocks = -(-(max(len(p) for p in prompts) + 10) // block_size) + spare_blocks  # the longest fits
    engine = make_engine(tiny_checkpoint, num_blocks=num_blocks, block_size=block_size, caching=caching,
                         max_model_len=32, max_num_batched_tokens=5 if chunked else 32, enable_chunked_prefill=chunked,
                         preemption_mode=mode)
    engine.proposer = proposer
    assert outputs(engine, prompts, GREEDY) == baseline
    if method == "draft is the target":  # the target agrees with itself: every verified draft is accepted
        assert engine.num_accepted_tokens == engine.num_draft_tokens


def test_a_step_emits_up_to_k_plus_one_tokens_and_fewer_steps_run(tiny_checkpoint):
    """The target drafting for itself: every step that verifies k drafts emits k + 1 tokens."""
    plain = make_engine(tiny_checkpoint)
    speculative = make_engine(tiny_checkpoint)
    speculative.proposer = DraftModelProposer(LlamaModel(tiny_checkpoint.config, tiny_checkpoint.weights), 3)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    assert outputs(speculative, [[1, 2, 3]], params) == outputs(plain, [[1, 2, 3]], params)
    # 1 prefill step + 12 decodes without speculation; with it, the decodes emit 4 tokens a step: 3 steps.
    assert (len(plain.trace), len(speculative.trace)) == (13, 4)
    assert [s.num_new_tokens for out in speculative.trace for s in out.scheduled] == [3, 4, 4, 4]
    assert speculative.num_draft_tokens == speculative.num_accepted_tokens == 9


def test_seeded_speculative_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_checkpoint):
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=2)
    prompts = [[1, 2, 1, 2, 1], [3, 3, 3]]
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_checkpoint)
        engine.proposer = proposer
        runs.append(outputs(engine, prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)))
    assert runs[0] == runs[1]
    engine = make_engine(tiny_checkpoint)
    engine.proposer = proposer
    top1 = outputs(engine, prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True))
    assert engine.num_draft_tokens > 0  # the filters apply at every verified position
    assert top1 == outputs(make_engine(tiny_checkpoint), prompts, GREEDY)


# ------------------------------------------------------------------------------ block accounting
class SpeculativeScheduling(RuleBasedStateMachine):
    """The real Scheduler and BlockManager, with a random "model": each step every verified request accepts a
    random prefix of its drafts, then proposes new random drafts, as the engine's proposer would."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]), num_host_blocks=st.integers(0, 6),
                caching=st.booleans(), chunked=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
                budget=st.integers(4, 16))
    def setup(self, num_blocks, block_size, num_host_blocks, caching, chunked, mode, budget):
        config = SchedulerConfig(max_num_seqs=3, max_model_len=16, max_num_batched_tokens=budget if chunked else 16,
                                 enable_chunked_prefill=chunked, preemption_mode=mode)
        self.bm = BlockManager(num_blocks, block_size, num_host_blocks, caching)
        self.scheduler = Scheduler(config, self.bm)
        self.next_id = 0
        self.verified_hashes: set = set()  # the hash of every block that was ever full of verified tokens

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=8), max_tokens=st.integers(1, 8))
    def add_request(self, prompt, max_tokens):
        request = Request(f"r{self.next_id}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens), self.next_id)
        self.next_id += 1
        try:
            self.scheduler.add_request(request)
        except ValueError:
            pass  # too long for the model or the cache: refused, as the engine refuses it

    @rule(data=st.data())
    def abort(self, data):
        unfinished = [r for r in self.scheduler.requests.values() if not r.status.is_finished]
        if unfinished:
            self.scheduler.abort_request(data.draw(st.sampled_from(unfinished)).request_id)

    @rule(data=st.data())
    def step(self, data):
        out = self.scheduler.schedule()
        emitted = {}
        for s in out.scheduled:
            request = self.scheduler.requests[s.request_id]
            drafts = request.spec_token_ids
            assert s.num_new_tokens == request.num_tokens - request.num_computed_tokens + len(drafts) or not drafts
            if request.num_computed_tokens + s.num_new_tokens >= request.num_tokens:
                accepted = data.draw(st.integers(0, len(drafts)))
                emitted[s.request_id] = drafts[:accepted] + [data.draw(st.sampled_from([0, 1, EOS]))]
        self.scheduler.update_from_output(out, emitted, (EOS,))
        for request in self.scheduler.requests.values():
            self.verified_hashes.update(self._verified_block_hashes(request))
        for request in self.scheduler.running:  # propose, capped as ReferenceEngine._propose caps
            if request.num_computed_tokens == request.num_tokens - 1:
                room = request.max_num_tokens - request.num_tokens - 1
                request.spec_token_ids = data.draw(st.lists(st.integers(0, 1), max_size=max(0, min(4, room))))

    # --------------------------------------------------------------------------- invariants
    def _verified_block_hashes(self, request):
        hashes, size = [], self.bm.block_size
        for i in range(request.num_computed_tokens // size):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, request.token_ids[i * size : (i + 1) * size]))
        return hashes

    def _held(self):
        return {r.request_id: self.bm.block_tables[r.request_id] for r in self.scheduler.running + self.scheduler.swapped}

    @invariant()
    def ref_counts_match_holders_and_free_plus_held_is_total(self):
        if not hasattr(self, "bm"):
            return
        assert set(self.bm.block_tables) == set(self._held())  # finished and waiting requests hold nothing
        for pool, resident in ((self.bm.device, True), (self.bm.host, False)):
            holders = [0] * pool.num_blocks
            for seq, table in self._held().items():
                if (seq not in self.bm.swapped_out) == resident:
                    for block in table:
                        holders[block.block_id] += 1
            assert [b.ref_cnt for b in pool.blocks] == holders
            assert all((b.block_id in pool.free_queue) == (b.ref_cnt == 0) for b in pool.blocks)

    @invariant()
    def rejected_drafts_leave_no_blocks_and_only_verified_blocks_are_cached(self):
        if not hasattr(self, "bm"):
            return
        for request in self.scheduler.running:
            assert len(self.bm.block_tables[request.request_id]) <= self.bm.num_blocks_for(request.num_tokens)
            table, hashes = self.bm.block_tables[request.request_id], self._verified_block_hashes(request)
            assert all(block.block_hash in (None, h) for block, h in zip(table, hashes))
        assert self.bm.device.cached_blocks.keys() <= self.verified_hashes  # free cached blocks too

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort_request(request_id)
        for pool in (self.bm.device, self.bm.host):
            assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


TestSpeculativeScheduling = SpeculativeScheduling.TestCase
