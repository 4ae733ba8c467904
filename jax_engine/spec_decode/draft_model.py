"""Draft-model proposing: a cheaper model with the target's vocabulary drafts its greedy tokens, with a paged KV
cache of its own, so each draft costs it one token of compute (reference/speculative.py's DraftModelProposer
recomputes the whole context instead).

After a step a sequence has N tokens, and the draft holds the K/V of the first `computed` of them:

    catch-up      one draft step computes tokens [computed, N) of every proposing sequence: the logits of
                  the last one give draft 1 (chunked to the step's token budget: a sequence whose prompt
                  does not fit catches up over several steps and drafts nothing until then)
    k - 1 steps   each feeds every sequence's newest draft (one token each) and takes the next from its logits
    next time     the draft keeps the K/V of the drafts it fed that the sequence kept (those up to the first
                  rejected one), and its table gives back the blocks past them

The cache has its own block tables (a KVCacheManager over the draft's own blocks) and as many blocks as the
target's: the planner splits the memory so both hold the same number of tokens (kv_cache_plan.py's plan_kv_cache).
Sequences share none of the draft's blocks: a prefix cache here would need the target's cache salts to keep
one user's timing from revealing another's prompt, for a draft prefill that costs little.

A draft is only a proposal, since verification emits the target's tokens whatever was drafted
(verification.py): a sequence can go without drafts (no blocks left, a prompt still catching up, preempted and
back) and no output changes. A sequence that leaves the running batch (finished, aborted, preempted) frees its
draft blocks at the next proposal.
"""

from dataclasses import dataclass, field

from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from jax_engine.loader import Checkpoint, load_checkpoint
from jax_engine.models.causal_lm import CausalLM
from jax_engine.runner.model_runner import ModelRunner
from jax_engine.sequence import Sequence
from jax_engine.spec_decode.config import SpeculativeConfig


def load_draft_model(spec: SpeculativeConfig | None, target: Checkpoint, dtype, mesh,
                     max_model_len: int) -> CausalLM | None:
    """The draft model a speculative config names (None for other methods), its weights on the target's devices.

    Raises ValueError when it cannot draft for the target: another vocabulary (its token ids would mean other
    tokens) or fewer positions than max_model_len."""
    if spec is None or spec.method != "draft_model":
        return None
    draft = target if spec.model == "self" else load_checkpoint(spec.model)
    if draft is not target:
        if draft.config.vocab_size != target.config.vocab_size or (
                draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()):
            raise ValueError(f"speculative_config['model'] ({spec.model}) must share the target's tokenizer: its "
                             f"vocabulary ({draft.config.vocab_size} rows, {len(draft.tokenizer)} tokens) is not the "
                             f"target's ({target.config.vocab_size} rows, {len(target.tokenizer)} tokens)")
        if draft.config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config['model'] ({spec.model}) has max_position_embeddings "
                             f"{draft.config.max_position_embeddings}, fewer than max_model_len ({max_model_len}): "
                             "lower max_model_len")
    return CausalLM.from_hf_weights(draft.config, draft.weights, dtype, spec.quantization, draft.blocks, mesh)


@dataclass
class DraftState:
    """What the draft's cache holds of one sequence: the K/V of its first `computed` tokens, the last
    `len(fed_drafts)` of which were drafts (tokens the sequence may not have kept)."""

    computed: int = 0
    fed_drafts: list[int] = field(default_factory=list)

    def valid_tokens(self, token_ids: list[int]) -> int:
        """How many of the computed tokens the sequence still has: its own, and the drafts it accepted."""
        base = self.computed - len(self.fed_drafts)
        kept = next((i for i, draft in enumerate(self.fed_drafts) if base + i >= len(token_ids)
                     or token_ids[base + i] != draft), len(self.fed_drafts))
        return base + kept


@dataclass
class DraftView:
    """A sequence as the draft's runner reads it (ModelRunner.prepare): its tokens and then its drafts so far,
    `num_computed_tokens` of them in the draft's cache."""

    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: tuple = ()  # the draft verifies nothing: one sampled row per sequence

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tokens_to_compute(self, n: int) -> list[int]:
        return self.token_ids[self.num_computed_tokens : self.num_computed_tokens + n]


class DraftModelProposer:
    """Drafts for every proposing sequence at once: a catch-up step, then one step per further draft."""

    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens  # the catch-up step's budget, as the target's
        self.cache = KVCacheManager(runner.num_slots // runner.block_size, runner.block_size,
                                    enable_prefix_caching=False)
        self.states: dict[str, DraftState] = {}

    def release_all_but(self, seq_ids: set[str]) -> None:
        """Free the draft's blocks of every sequence not in `seq_ids` (those that finished or were preempted)."""
        for seq_id in self.states.keys() - seq_ids:
            del self.states[seq_id]
            self.cache.free(seq_id)
            self.cache.forget(seq_id)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Up to k greedy drafts for each (sequence, k) of `wanted`: for those whose draft cache has room
        and whose context it has caught up with."""
        budget = self.max_num_batched_tokens
        catch_up, drafting = [], []
        for seq, k in wanted:
            scheduled = self._catch_up(seq, k, budget)
            if scheduled is not None:
                budget -= scheduled.num_new_tokens
                catch_up.append(scheduled)
                if scheduled.seq.num_computed_tokens + scheduled.num_new_tokens == seq.num_tokens:
                    drafting.append((seq, k))
        drafts: dict[str, list[int]] = {seq.seq_id: [] for seq, _ in drafting}
        scheduled = catch_up
        while scheduled:
            for s, token in zip(scheduled, self._step(scheduled)):
                self.states[s.seq.seq_id].computed += s.num_new_tokens
                if token is not None:
                    drafts[s.seq.seq_id].append(token)
            scheduled = [self._feed(seq, drafts[seq.seq_id]) for seq, k in drafting if len(drafts[seq.seq_id]) < k]
        for seq, _ in drafting:  # every draft but the newest was fed
            self.states[seq.seq_id].fed_drafts = drafts[seq.seq_id][:-1]
        return {seq: drafts[seq.seq_id] for seq, _ in drafting}

    def _catch_up(self, seq: Sequence, k: int, budget: int) -> ScheduledSequence | None:
        """The catch-up share of `seq`: its tokens the draft has not computed (at most `budget`), with blocks
        for them and the k - 1 drafts to be fed after them; None when the draft's cache has no room."""
        tokens, cache = seq.all_token_ids, self.cache
        state = self.states.get(seq.seq_id)
        if state is None:
            if not cache.can_allocate(seq.seq_id, tokens):
                return None
            cache.allocate(seq.seq_id, tokens)
            state = self.states[seq.seq_id] = DraftState()
        else:  # drop the rejected drafts; the last token's logits are needed, so it is always computed
            state.computed, state.fed_drafts = min(state.valid_tokens(tokens), len(tokens) - 1), []
            cache.trim(seq.seq_id, state.computed)
        chunk = min(len(tokens) - state.computed, budget)
        if chunk <= 0:
            return None
        slots = len(tokens) + k - 1 - state.computed if chunk == len(tokens) - state.computed else chunk
        if not cache.can_append_slots(seq.seq_id, state.computed, slots):
            return None
        copies = cache.append_slots(seq.seq_id, state.computed, slots)
        assert not copies, "the draft shares no blocks, so it never copies one on write"
        return ScheduledSequence(DraftView(seq.seq_id, tokens, state.computed), chunk, cache.block_tables[seq.seq_id])

    def _feed(self, seq: Sequence, drafts: list[int]) -> ScheduledSequence:
        """A step's share of `seq` that feeds its newest draft (its blocks are already allocated)."""
        view = DraftView(seq.seq_id, seq.all_token_ids + drafts, self.states[seq.seq_id].computed)
        return ScheduledSequence(view, 1, self.cache.block_tables[seq.seq_id])

    def _step(self, scheduled: list[ScheduledSequence]) -> list[int | None]:
        """One step of the draft model; the greedy next token of each scheduled sequence whose tokens are all
        computed after it, None for the others (catching up)."""
        inputs = self.runner.prepare(SchedulerOutput(scheduled=scheduled))
        sampling_hidden, _ = self.runner.execute(inputs)
        if not inputs.sampling_seqs:  # every sequence is still catching up (no program has zero rows)
            return [None] * len(scheduled)
        tokens = dict(zip((view.seq_id for view in inputs.sampling_seqs),
                          self.runner.greedy_tokens(sampling_hidden, len(inputs.sampling_seqs))))
        return [tokens.get(s.seq.seq_id) for s in scheduled]
