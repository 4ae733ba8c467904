"""Async scheduling (vLLM's --async-scheduling): plan the next step on the host while the device runs this one.

In lockstep the device waits while the host reads a step's tokens, updates the sequences, makes their outputs,
schedules the next step and lays out its inputs; and the host waits while the device computes:

    lockstep   host:   schedule N, prepare N |          | read N, update, outputs N, schedule N+1, prepare N+1 |
               device:                       | step N   |                                                      | N+1

With async scheduling the host schedules and prepares step N+1 while step N still runs, counting one token for
each sequence that samples in N (a stand-in, as vLLM's output placeholders). Then it waits for N's tokens, puts
them in N+1's inputs in place of the stand-ins, starts N+1, and makes N's outputs while N+1 runs:

    async      host:   schedule N+1, prepare N+1 | read N, patch, start N+1 | outputs N, schedule N+2 ...
               device: step N ...................|                          | step N+1 ...

No output changes: each token is still sampled from the same logits with the same seed and position, and a
sequence N's token finishes (EOS, a stop token or string, an abort) wastes one row of N+1, whose token is
dropped. What changes is the plan: N+1 is made before N's finished sequences free their blocks and rows.

Requests that need N's token on the host before N+1 can be planned run in lockstep, as vLLM first did: beam
search (the beams chosen decide who runs next), parallel samples (forks), structured output (the next mask
needs the grammar advanced), prompt logprobs, and every step of an engine with speculative decoding or the
embedding task. While such a request is unfinished the engine steps in lockstep, finishing a step in flight
first.
"""

from dataclasses import dataclass

from jax_engine.core.scheduler import Scheduler
from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.runner.model_runner import StepInputs
from jax_engine.sample.sampler import SampledToken
from jax_engine.sample.step_sampler import PendingTokens
from jax_engine.sequence import Sequence
from jax_engine.sequence_group import SequenceGroup

STAND_IN = 0  # the token id a sequence holds while its real token is being sampled; never computed


@dataclass
class StepInFlight:
    """A step the device may still be running: its plan and its sampled tokens, not read yet."""

    out: SchedulerOutput
    pending: PendingTokens


def runs_ahead(group: SequenceGroup) -> bool:
    """Whether a request's next step can be planned before its current token is known (see the module doc)."""
    first = group.seqs[0]
    return (not group.is_beam_search and len(group.seqs) == 1 and first.grammar is None
            and getattr(group.params, "prompt_logprobs", None) is None)


def plan_ahead(scheduler: Scheduler, step: StepInFlight) -> list[Sequence]:
    """Before `step`'s tokens are known: count its tokens computed, and give each sequence that samples in it a
    stand-in for its token, so that the scheduler plans the next step with that token in it. A sequence the
    token surely ends (it reaches max_tokens) gets none: the next step has no work for it. Returns those that
    got one."""
    scheduler.update_computed(step.out)
    stand_ins = [seq for seq in step.pending.seqs
                 if not seq.status.is_finished and seq.num_output_tokens + 1 < seq.max_tokens]
    for seq in stand_ins:
        seq.all_token_ids.append(STAND_IN)
    return stand_ins


def resolve(scheduler: Scheduler, step: StepInFlight, stand_ins: list[Sequence],
            next_inputs: StepInputs | None) -> list[tuple[Sequence, SampledToken]]:
    """Wait for `step`'s tokens, append them in place of the stand-ins (finishing the sequences they end), and
    write them into the next step's inputs where the stand-ins were laid out. Returns the tokens appended."""
    sampled = step.pending.tokens()
    for seq in stand_ins:
        seq.all_token_ids.pop()
    appended = scheduler.append_sampled(step.out, sampled)
    row_of = {} if next_inputs is None else next_inputs.row_of
    for seq in stand_ins:
        if seq.seq_id in row_of:  # scheduled next: its one new token is the one just sampled
            next_inputs.token_ids[row_of[seq.seq_id]] = seq.all_token_ids[-1]
    return appended
