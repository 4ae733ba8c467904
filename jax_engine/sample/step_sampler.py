"""A step's sampling on the host side: which rows sample, the grammar masks, and faults that stay with their request.

The model runner samples rows of logits on the device (jax_engine/sample/sampler.py). Around that call the engine
must decide who samples from which row (a parallel sample reads its parent's row on the step its parent's
prompt is done, then forks), fill the structured-output masks on the host while the device still runs the
forward pass, and keep one request's bad values from failing the others: a request whose grammar matcher
broke, or whose values do not pack into the sampler's arrays, fails alone and the rest are sampled again.
"""

from collections.abc import Callable
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from jax_engine.sample.sampler import SampledRows, SampledToken
from jax_engine.sample.sampling_batch import sampling_batch
from jax_engine.sequence import Sequence
from jax_engine.structured_output.grammar import GrammarCompiler, GrammarError

if TYPE_CHECKING:  # the runner imports the sampler; the step sampler only calls the runner it is given
    from jax_engine.runner.model_runner import ModelRunner

FailingAlone = Callable[[Sequence], AbstractContextManager]  # LLMEngine._failing_alone


@dataclass(frozen=True)
class PendingTokens:
    """The tokens a step samples, while the device may still draw them: `tokens()` waits for them."""

    seqs: list[Sequence]  # who samples, in row order
    rows: SampledRows

    def tokens(self) -> list[tuple[Sequence, SampledToken]]:
        return list(zip(self.seqs, self.rows.read()))


class StepSampler:
    def __init__(self, runner: "ModelRunner", grammar_compiler: GrammarCompiler, vocab_size: int) -> None:
        self.runner = runner
        self.grammar_compiler = grammar_compiler
        self.vocab_size = vocab_size

    def sample(self, sampling_hidden, samplers: list[tuple[int, Sequence]],
               failing_alone: FailingAlone) -> PendingTokens:
        """A token for each (logits row, sequence) whose request has not failed; dispatched, read later.

        failing_alone is given at each call, not kept: kept, the engine's bound method would make a cycle (engine,
        step sampler, engine) that only the garbage collector frees, so a dropped LLM would hold its KV cache
        until the next full collection."""
        samplers = [(row, seq) for row, seq in samplers if not seq.status.is_finished]
        rows, seqs = [row for row, _ in samplers], [seq for _, seq in samplers]
        # A drafted position's row (spec_decode's DraftPosition, which is no Sequence) is filled by its sequence's
        # matcher, which walks the drafts before it.
        grammars = [seq.grammar if isinstance(seq, Sequence) else None for seq in seqs]
        drafts = [seq.spec_token_ids if grammar else [] for seq, grammar in zip(seqs, grammars)]
        bitmask = self.grammar_compiler.fill_bitmask(grammars, drafts) if any(grammars) else None
        if self._fail_broken_grammars(seqs, failing_alone):
            return self.sample(sampling_hidden, samplers, failing_alone)
        try:
            batch = self.runner.sampling_batch(seqs, bitmask)
            return PendingTokens(seqs, self.runner.sample(sampling_hidden, rows, batch))
        except Exception:  # some sequence's values do not pack into the sampler's arrays: it fails alone
            for seq in seqs:
                with failing_alone(seq):
                    sampling_batch([seq], 1, self.vocab_size)
            if not any(seq.status.is_finished for seq in seqs):
                raise  # not a packing fault: the step itself failed
            return self.sample(sampling_hidden, samplers, failing_alone)

    @staticmethod
    def _fail_broken_grammars(seqs: list[Sequence], failing_alone: FailingAlone) -> bool:
        """Fail the requests whose grammar matcher stopped (its mask passed the library's per-step budget):
        their masks allow nothing meaningful. True if any did."""
        broken = [seq for seq in seqs if isinstance(seq, Sequence)  # not again for each of its drafted positions
                  and seq.grammar is not None and seq.grammar.error is not None]
        for seq in broken:
            seq.stop_reason = f"structured output stopped: {seq.grammar.error[:500]}"  # its output says why
            with failing_alone(seq):
                raise GrammarError(seq.stop_reason)
        return bool(broken)
