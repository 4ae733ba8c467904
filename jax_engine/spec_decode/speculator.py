"""The engine's side of speculative decoding: draft after each step, verify in the next, count what was accepted."""

from jax_engine.sample.sampler import SampledToken
from jax_engine.sequence import Sequence
from jax_engine.spec_decode.config import SpeculativeConfig
from jax_engine.spec_decode.ngram_proposer import propose_ngram
from jax_engine.spec_decode.verification import DraftPosition, accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        k = config.num_speculative_tokens
        # vLLM's counters: verification steps, drafted and accepted tokens, and accepted tokens by draft position.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k

    @classmethod
    def create(cls, config: SpeculativeConfig | None, max_model_len: int) -> "Speculator | None":
        return None if config is None else cls(config, max_model_len)

    def propose(self, running: list[Sequence], groups: dict) -> None:
        """Draft the next tokens of every running sequence that just sampled one; the next step verifies them.
        Nothing while disable_by_batch_size or more sequences run, nor for beam search; a sequence following a
        grammar drafts only what its grammar allows (verification masks each drafted position after the drafts
        before it). `groups` are the requests' SequenceGroups."""
        config = self.config
        if config.disable_by_batch_size is not None and len(running) >= config.disable_by_batch_size:
            return
        for seq in running:
            if seq.num_computed_tokens == seq.num_tokens - 1 and not groups[seq.request_id].is_beam_search:
                # A step emits up to drafts + 1 tokens: none past max_tokens or max_model_len.
                room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
                k = min(config.num_speculative_tokens, room)
                drafts = propose_ngram(seq.all_token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max)
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
