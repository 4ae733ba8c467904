"""The engine's side of speculative decoding: draft after each step, verify in the next, count what was accepted."""

from jax_engine.runner.model_runner import ModelRunner
from jax_engine.sample.sampler import SampledToken
from jax_engine.sequence import Sequence
from jax_engine.spec_decode.config import SpeculativeConfig
from jax_engine.spec_decode.draft_model import DraftModelProposer
from jax_engine.spec_decode.ngram_proposer import propose_ngram
from jax_engine.spec_decode.verification import DraftPosition, accepted
from reference.scheduler import SchedulerConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft  # method "draft_model"; n-gram drafts need nothing but the context
        k = config.num_speculative_tokens
        # vLLM's counters: verification steps, drafted and accepted tokens, and accepted tokens by draft position.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k

    @classmethod
    def create(cls, config: SpeculativeConfig | None, scheduler_config: SchedulerConfig,
               draft_runner: ModelRunner | None = None) -> "Speculator | None":
        """The speculator `config` asks for (None: no speculation), drafting with `draft_runner` if it names a
        draft model (worker.load_model loads one)."""
        if config is None:
            return None
        draft = None if draft_runner is None else DraftModelProposer(draft_runner,
                                                                     scheduler_config.max_num_batched_tokens)
        return cls(config, scheduler_config.max_model_len, draft)

    @property
    def runners(self) -> list[ModelRunner]:
        """The draft model's runner, whose programs the engine's statistics count too (none for n-gram drafts)."""
        return [] if self.draft is None else [self.draft.runner]

    def propose(self, running: list[Sequence], groups: dict) -> None:
        """Draft the next tokens of every running sequence that just sampled one; the next step verifies them.
        Nothing while disable_by_batch_size or more sequences run, nor for beam search; a sequence following a
        grammar drafts only what its grammar allows (verification masks each drafted position after the drafts
        before it). `groups` are the requests' SequenceGroups."""
        config = self.config
        if self.draft is not None:
            self.draft.release_all_but({seq.seq_id for seq in running})
        if config.disable_by_batch_size is not None and len(running) >= config.disable_by_batch_size:
            return
        wanted = []
        for seq in running:
            if seq.num_computed_tokens == seq.num_tokens - 1 and not groups[seq.request_id].is_beam_search:
                # A step emits up to drafts + 1 tokens: none past max_tokens or max_model_len.
                room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
                if room > 0:
                    wanted.append((seq, min(config.num_speculative_tokens, room)))
        if self.draft is not None:
            drafted = self.draft.propose(wanted)
        else:
            drafted = {seq: propose_ngram(seq.all_token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max)
                       for seq, k in wanted}
        for seq, drafts in drafted.items():
            seq.spec_token_ids = drafts if seq.grammar is None else seq.grammar.valid_prefix(drafts)

    def verify(self, sampled: list[tuple[Sequence | DraftPosition, SampledToken]]) -> list[tuple[Sequence, SampledToken]]:
        """The tokens each sequence emits (verification.accepted), counted."""
        emitted = accepted(sampled)
        counts: dict[Sequence, int] = {}
        for seq, _ in emitted:
            counts[seq] = counts.get(seq, 0) + 1
        for seq, count in counts.items():
            if seq.spec_token_ids:
                self.num_drafts += 1
                self.num_draft_tokens += len(seq.spec_token_ids)
                self.num_accepted_tokens += count - 1
                for position in range(count - 1):
                    self.num_accepted_tokens_per_pos[position] += 1
        return emitted

    def stats(self) -> dict:
        """vLLM's spec-decode figures: the counters, the acceptance rate (accepted / drafted tokens), the mean
        acceptance length (tokens emitted per verification step, the bonus token included), and the acceptance
        rate at each draft position."""
        drafts = max(self.num_drafts, 1)
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts,
            "acceptance_rate_per_pos": [n / drafts for n in self.num_accepted_tokens_per_pos],
        }
