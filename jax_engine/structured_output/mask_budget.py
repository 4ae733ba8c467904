"""A bound on the time of each grammar's mask.

llguidance bounds a mask's work with its fuel (worker.LIMITS), but not all of it: matching a long literal costs
time in proportion to its length and no fuel. A 500,000-character const took ~130 ms for every mask, so it added
that to every step of every request in the batch for as long as its own request ran; ordinary grammars take well
under a millisecond. A step's masks are computed together, in parallel. While that takes longer than
MASK_LIMIT_SECONDS, the next steps compute each row's mask on its own and time it (the CPU time of its thread:
what the other requests wait for, whatever the machine's load; a row with speculative drafts, whose masks the
library walks on its own threads, by the wall time per mask), and a matcher whose mask took longer is stopped:
its request ends with a GrammarError (a 400 naming the field over HTTP) after two or three such steps.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

if TYPE_CHECKING:
    from jax_engine.structured_output.grammar import GrammarMatcher

MASK_LIMIT_SECONDS = 0.02


class MaskBudget:
    """Fills the bitmask rows of matchers, and stops the matchers whose masks cost too much."""

    def __init__(self, executor: llguidance.LLExecutor) -> None:
        self._executor = executor
        self._pool = ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="mask")
        self._timing = False  # whether the last masks took longer than one may: time each row on its own

    def fill(self, rows: list[tuple["GrammarMatcher", int]], drafted: list[tuple["GrammarMatcher", int, list[int]]],
             bitmask: np.ndarray) -> None:
        """Fill bitmask[i] with what each (matcher, i) in `rows` allows next; and for each (matcher, i, drafts) in
        `drafted` (speculative decoding), bitmask[i + k] with what it allows after its first k drafts."""
        started = time.perf_counter()
        if self._timing:
            self._fill_timed(rows, drafted, bitmask)
        else:  # in parallel, outside the GIL
            if rows:
                llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m.state, i) for m, i in rows], bitmask)
            if drafted:  # the matchers walk their drafts and back
                llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                    self._executor, [(m.state, i, drafts) for m, i, drafts in drafted], bitmask)
        self._timing = time.perf_counter() - started > MASK_LIMIT_SECONDS

    def _fill_timed(self, rows, drafted, bitmask: np.ndarray) -> None:
        for (matcher, _), seconds in zip(rows, list(self._pool.map(lambda row: _timed(row, bitmask), rows))):
            _stop_if_slow(matcher, seconds)
        for matcher, index, drafts in drafted:  # the library walks them on its own threads: wall time per mask
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(matcher.state, index, drafts)], bitmask)
            _stop_if_slow(matcher, (time.perf_counter() - started) / (len(drafts) + 1))


def _stop_if_slow(matcher: "GrammarMatcher", seconds: float) -> None:
    if seconds > MASK_LIMIT_SECONDS:
        matcher.over_budget = (f"a mask took {seconds * 1000:.0f} ms of CPU, more than the limit of "
                               f"{MASK_LIMIT_SECONDS * 1000:.0f} ms (long literals cost time)")


def _timed(row: tuple["GrammarMatcher", int], bitmask: np.ndarray) -> float:
    """Fill one row; the CPU seconds it took."""
    matcher, index = row
    started = time.thread_time()
    llguidance.numpy.fill_next_token_bitmask(matcher.state, bitmask, index)
    return time.thread_time() - started
