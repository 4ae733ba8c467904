"""The pooler: an embedding request's vector from the hidden states of its prompt (vLLM's Pooler).

    LAST   the final norm's output at the prompt's last token: the only position that attends to every token
    MEAN   the average of that output over every prompt token

A prompt may be computed over several steps (chunked prefill), so MEAN adds each step's rows of the request to
a running sum. (Nothing preempts a pooling request mid-prompt: the scheduler gives it its whole prompt's blocks
when it admits it, and it never asks for more. Should a prompt be computed again from position 0, its sum would
start again too.)

MEAN needs every prompt token's row, so an engine that pools by MEAN runs without the prefix cache (as vLLM's
does): a cached block's tokens are never computed. LAST needs only the last token, which a step always computes.
Rows are read on the host (one transfer of the step's hidden states), so pooling compiles nothing.
"""

import dataclasses
import logging

import numpy as np

from jax_engine.config import EngineArgs
from jax_engine.core.scheduler import Scheduler
from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.outputs import PoolingOutput, PoolingRequestOutput
from jax_engine.pooling_params import PoolerConfig, PoolingParams
from jax_engine.sample.sampler import to_host
from jax_engine.sequence_group import SequenceGroup
from reference.request import RequestStatus

logger = logging.getLogger(__name__)


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._params: dict[str, PoolingParams] = {}  # by seq_id, every pooling request not yet pooled
        self._sums: dict[str, np.ndarray] = {}  # MEAN: the rows added so far, by seq_id

    @classmethod
    def for_engine(cls, args: EngineArgs) -> tuple["Pooler | None", EngineArgs]:
        """The pooler of an engine started with task="embed" (None for "generate"), and the engine's arguments
        as it needs them: no prefix cache when the pooler reads every token."""
        if args.task != "embed":
            return None, args
        pooler = cls(PoolerConfig.of(args.pooler_config))
        if pooler.needs_every_token and args.enable_prefix_caching:
            logger.info("pooling_type MEAN reads every prompt token: the prefix cache is off")
            args = dataclasses.replace(args, enable_prefix_caching=False)
        return pooler, args

    @property
    def needs_every_token(self) -> bool:
        """Whether a request's vector reads every prompt token's row (then nothing may come from the cache)."""
        return self.config.pooling_type == "MEAN"

    def add(self, seq_id: str, params: PoolingParams) -> None:
        self._params[seq_id] = params

    def forget(self, seq_id: str) -> None:
        """Drop a request that ends without its vector (aborted)."""
        self._params.pop(seq_id, None)
        self._sums.pop(seq_id, None)

    def step(self, out: SchedulerOutput, row_of: dict[str, int], hidden, scheduler: Scheduler) -> dict[str, np.ndarray]:
        """An embedding engine's step after the model ran `out` (`hidden`: its rows, each sequence's from
        `row_of` on): the computed counts advance, and the requests whose prompt is now computed get their vector
        and end. Returns the vectors, by seq_id (a pooling request's one sequence has the request's id)."""
        vectors = self._pool(out, row_of, hidden)
        scheduler.update_from_output(out, [])
        scheduler.finish_requests(vectors, RequestStatus.FINISHED_STOPPED)
        return vectors

    def output(self, group: SequenceGroup, vector: np.ndarray | None) -> PoolingRequestOutput:
        """A request's output: its vector, or None when it was aborted (its data is then empty)."""
        if vector is None:
            self.forget(group.seqs[0].seq_id)
            vector = np.zeros(0, np.float32)
        return PoolingRequestOutput(group.request_id, PoolingOutput(vector), group.prompt_token_ids)

    def _pool(self, out: SchedulerOutput, row_of: dict[str, int], hidden) -> dict[str, np.ndarray]:
        """The vectors of the requests whose prompt this step finished computing, by seq_id. Call before the
        scheduler advances the computed counts."""
        pooling = [s for s in out.scheduled if s.seq.seq_id in self._params and not s.seq.status.is_finished]
        if not pooling:
            return {}
        rows = to_host(hidden).astype(np.float64)  # sums of up to max_model_len rows, kept exact enough
        vectors = {}
        for s in pooling:
            seq, first = s.seq, s.seq.num_computed_tokens
            mine = rows[row_of[seq.seq_id] : row_of[seq.seq_id] + s.num_new_tokens]
            if self.needs_every_token:
                total = self._sums.get(seq.seq_id) if first > 0 else None  # position 0: a fresh sum
                self._sums[seq.seq_id] = mine.sum(axis=0) + (0.0 if total is None else total)
            if first + s.num_new_tokens == seq.num_prompt_tokens:
                vectors[seq.seq_id] = self._vector(seq.seq_id, mine[-1], seq.num_prompt_tokens)
        return vectors

    def _vector(self, seq_id: str, last_row: np.ndarray, num_tokens: int) -> np.ndarray:
        params = self._params.pop(seq_id)
        vector = self._sums.pop(seq_id) / num_tokens if self.needs_every_token else last_row
        vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = vector / max(np.linalg.norm(vector), 1e-12)  # torch's F.normalize guards zero the same way
        return vector.astype(np.float32)
