"""Verifying drafts with the ordinary sampler: each drafted position is sampled as plain decoding would sample it.

A sequence with drafts x_1..x_k gets k + 1 logits rows from one step. Row i is sampled exactly as plain decoding
samples position num_tokens + i, as if the drafts before it were already its output: its penalties and bad words
count them, its draw uses the same (seed, position) key. The accepted drafts are the prefix where the sampled
token equals the draft; the first sampled token that differs (or the one after the last draft) ends the step.

This is the rejection sampler of reference/speculative.py for drafts whose q is one-hot (prompt lookup), in a
coupled form: a draft x survives with probability p(x), and on rejection the token is drawn from p without x,
which is norm(max(0, p - q)). Coupled, it changes no output at all: every emitted token is the one the same
position's draw gives without speculation (tests/test_speculative_engine.py checks both).
"""

from dataclasses import dataclass

from jax_engine.sample.sampler import SampledToken
from jax_engine.sequence import Sequence


@dataclass(eq=False)
class DraftPosition:
    """`seq` as the sampler sees it at its drafted position `num_drafts`: its tokens, then that many drafts."""

    seq: Sequence
    num_drafts: int

    def __getattr__(self, name: str):  # everything else (params, seed, grammar, status) is the sequence's
        return getattr(self.seq, name)

    @property
    def all_token_ids(self) -> list[int]:
        return self.seq.all_token_ids + self.seq.spec_token_ids[: self.num_drafts]

    @property
    def token_ids(self) -> list[int]:
        return self.all_token_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + self.num_drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.seq.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.num_drafts


def with_draft_positions(samplers: list[tuple[int, Sequence]]) -> list[tuple[int, Sequence | DraftPosition]]:
    """The (logits row, sampler) pairs with a pair after each sequence for each of its drafts, in the rows
    that follow its own (the runner lays a sequence's drafted positions out after its last token's row)."""
    rows = []
    for row, seq in samplers:
        rows.append((row, seq))
        rows += [(row + i, DraftPosition(seq, i)) for i in range(1, len(seq.spec_token_ids) + 1)]
    return rows


def accepted(sampled: list[tuple[Sequence | DraftPosition, SampledToken]]) -> list[tuple[Sequence, SampledToken]]:
    """Each sequence's emitted tokens, in order: its sampled tokens up to the first that differs from its draft
    (inclusive), or all k + 1 when every draft matched."""
    by_seq: dict[Sequence, list[SampledToken]] = {}
    for sampler, token in sampled:
        by_seq.setdefault(sampler.seq if isinstance(sampler, DraftPosition) else sampler, []).append(token)
    emitted = []
    for seq, tokens in by_seq.items():
        drafts = seq.spec_token_ids
        num_accepted = next((i for i, draft in enumerate(drafts) if tokens[i].token != draft), len(drafts))
        emitted += [(seq, token) for token in tokens[: num_accepted + 1]]
    return emitted
