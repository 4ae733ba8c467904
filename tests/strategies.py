"""Hypothesis strategies shared by the reference's and the engine's scheduler tests."""

from hypothesis import strategies as st

from reference import SchedulerConfig
from reference.scheduling_policy import SCHEDULING_POLICIES

# Prompts over a 3-token vocabulary: short enough to fill tiny caches, repetitive enough to hit the prefix cache.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=12)


@st.composite
def scheduler_traces(draw, eos: int):
    """(SchedulerConfig, BlockManager arguments, [(arrival step, prompt, max_tokens, priority)], tokens sampled in
    turn). Under the "priority" policy requests get priorities in [-2, 2] (ties on purpose), else 0.

    Tiny caches (1-10 blocks of 1-4 tokens) and budgets, so preemption, swapping, chunking and refusals all
    happen within a few steps; the sampled tokens include `eos`, so some requests stop early.
    """
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(4, 24))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 4)), max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.integers(1, 24)) if chunked else draw(st.integers(max_model_len, 40)),
        enable_chunked_prefill=chunked, preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        policy=draw(st.sampled_from(SCHEDULING_POLICIES)))
    priorities = st.integers(-2, 2) if config.policy == "priority" else st.just(0)
    blocks = {"num_blocks": draw(st.integers(1, 10)), "block_size": draw(st.sampled_from([1, 2, 4])),
              "num_host_blocks": draw(st.integers(0, 8)), "enable_prefix_caching": draw(st.booleans())}
    requests = draw(st.lists(st.tuples(st.integers(0, 3), prompts, st.integers(1, 8), priorities), min_size=1,
                             max_size=8))
    tokens = draw(st.lists(st.sampled_from([0, 1, eos]), min_size=1, max_size=20))
    return config, blocks, requests, tokens
