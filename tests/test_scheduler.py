"""The reference scheduler: exact decisions on small cases, and properties over random traces."""

import pytest
from hypothesis import given

from reference import BlockManager, Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from reference.scheduling_policy import queue_order
from tests.strategies import scheduler_traces

EOS = 99


def make_scheduler(num_blocks=8, block_size=2, num_host_blocks=8, caching=True, **config):
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", max(64, config["max_model_len"]))
    bm = BlockManager(num_blocks, block_size, num_host_blocks, caching)
    return Scheduler(SchedulerConfig(**config), bm)


def add(scheduler, request_id, prompt, max_tokens, arrival, priority=0):
    request = Request(request_id, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), arrival, priority)
    scheduler.add_request(request)
    return request


def step(scheduler, token=7):
    """One engine step without a model: every request that completes its tokens samples `token`."""
    out = scheduler.schedule()
    sampled = {s.request_id: token for s in out.scheduled}
    finished = scheduler.update_from_output(out, sampled, eos_token_ids=(EOS,))
    return out, finished


def test_prefills_then_decodes_one_token_each():
    s = make_scheduler()
    add(s, "a", [1, 2, 3], 2, 0)
    add(s, "b", [4, 5], 2, 1)
    out, _ = step(s)
    assert [(x.request_id, x.num_new_tokens, x.block_table) for x in out.scheduled] == [("a", 3, [0, 1]), ("b", 2, [2])]
    out, finished = step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.scheduled[1].block_table == [2, 3]  # b's third token needed a second block
    assert [r.request_id for r in finished] == ["a", "b"]
    assert s.block_manager.device.num_free_blocks == 8


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    s = make_scheduler(enable_chunked_prefill=True, max_num_batched_tokens=4, max_model_len=32)
    add(s, "a", range(10), 1, 0)
    chunks = [step(s)[0].scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [4, 4, 2]
    assert s.requests["a"].status is RequestStatus.FINISHED_LENGTH


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = make_scheduler(max_num_batched_tokens=6, max_model_len=6)
    add(s, "a", range(4), 2, 0)
    add(s, "b", range(10, 14), 2, 1)
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a"]  # b's 4 tokens do not fit next to a's 4
    out, _ = step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 4)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_latest_arrival_is_preempted_when_blocks_run_out(mode):
    s = make_scheduler(num_blocks=4, block_size=2, preemption_mode=mode)
    add(s, "early", [1, 2], 4, 0)
    add(s, "late", [3, 4], 4, 1)
    step(s)  # both prefilled: 2 blocks used
    step(s)  # both decode into a second block: 4 blocks used
    step(s)
    out, _ = step(s)  # both need a third block; only "late" can give way
    assert out.preempted == ["late"]
    assert [x.request_id for x in out.scheduled] == ["early"]
    late = s.requests["late"]
    if mode == "swap":
        assert late.status is RequestStatus.SWAPPED and len(out.swap_out) == 2
    else:
        assert late.status is RequestStatus.WAITING and late.num_computed_tokens == 0 and out.swap_out == {}
    while s.has_unfinished_requests():
        step(s)
    assert s.requests["late"].output_token_ids == [7, 7, 7, 7]
    assert s.num_preemptions == 1 and s.block_manager.device.num_free_blocks == 4


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s = make_scheduler(num_blocks=4, block_size=2, num_host_blocks=0, preemption_mode="swap")
    add(s, "early", [1, 2], 4, 0)
    add(s, "late", [3, 4], 4, 1)
    for _ in range(4):
        step(s)
    assert s.requests["late"].status is RequestStatus.WAITING


def test_requests_that_can_never_fit_are_rejected():
    s = make_scheduler(num_blocks=2, block_size=2, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        add(s, "a", range(6), 3, 0)
    with pytest.raises(ValueError, match="num_blocks=2"):
        add(s, "b", range(4), 1, 1)


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32)


def test_priority_policy_admits_the_lowest_priority_value_first():
    """vLLM's "priority" policy: waiting requests run lowest priority value first, arrival breaking ties."""
    s = make_scheduler(policy="priority", max_num_seqs=1)
    for arrival, (name, priority) in enumerate([("late", 1), ("urgent", -1), ("tie", 1)]):
        add(s, name, [1, 2, 3], 1, arrival, priority)
    admitted = []
    while s.has_unfinished_requests():
        admitted += [x.request_id for x in step(s)[0].scheduled]
    assert admitted == ["urgent", "late", "tie"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "second"), ("priority", "first")])
def test_blocks_run_out_the_priority_policy_preempts_the_lowest_priority(policy, victim):
    """Two requests outgrow 4 blocks: FCFS preempts the later arrival, "priority" the one of higher value, though
    it came first (and runs second, behind the other)."""
    s = make_scheduler(num_blocks=4, policy=policy)
    add(s, "first", [1, 2, 3], 5, 0, 1 if policy == "priority" else 0)
    add(s, "second", [4, 5, 6], 5, 1)
    preempted = []
    while not preempted:
        preempted = step(s)[0].preempted
    assert preempted == [victim]


def test_a_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="priority must be 0 unless scheduling_policy is 'priority'"):
        add(make_scheduler(), "a", [1, 2], 1, 0, priority=3)
    with pytest.raises(ValueError, match="priority must be an int"):
        add(make_scheduler(policy="priority"), "a", [1, 2], 1, 0, priority=1.5)
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="lifo")


def test_abort_frees_blocks_wherever_the_request_is():
    s = make_scheduler()
    add(s, "a", [1, 2, 3], 5, 0)
    add(s, "b", [1, 2, 3], 5, 1)
    step(s)
    s.abort_request("a")
    s.abort_request("b")
    assert s.requests["a"].status is RequestStatus.FINISHED_ABORTED and not s.has_unfinished_requests()
    assert s.block_manager.device.num_free_blocks == 8


def test_prefix_cache_hit_skips_prefill_work():
    s = make_scheduler(num_blocks=16, block_size=2)
    system = [5, 6, 7, 8, 9, 10]
    add(s, "a", system + [1], 1, 0)
    assert step(s)[0].num_batched_tokens == 7
    add(s, "b", system + [2], 1, 1)
    out, _ = step(s)
    assert out.num_batched_tokens == 1 and s.requests["b"].num_cached_tokens == 6


# --------------------------------------------------------------------------- properties on traces
def _check_step(s: Scheduler, out, admitted_before: set[str]):
    config, bm = s.config, s.block_manager
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(s.running) <= config.max_num_seqs
    assert len({x.request_id for x in out.scheduled}) == len(out.scheduled)
    for x in out.scheduled:
        request = s.requests[x.request_id]
        assert x.num_new_tokens >= 1 and request.status is RequestStatus.RUNNING
        end = request.num_computed_tokens + x.num_new_tokens
        assert end <= request.num_tokens and len(x.block_table) >= bm.num_blocks_for(end)
        for position in range(request.num_computed_tokens, end):  # never write a shared block
            assert bm.block_tables[x.request_id][position // bm.block_size].ref_cnt == 1
        if not config.enable_chunked_prefill:
            assert end == request.num_tokens  # whole prompts only
    running_order = [queue_order(s.requests[x.request_id]) for x in out.scheduled]
    for victim in out.preempted:  # victims are the latest arrivals (under "priority": the lowest priority, then)
        assert all(queue_order(s.requests[victim]) > key for key in running_order)
    admitted = [x.request_id for x in out.scheduled if x.request_id not in admitted_before]
    if admitted:  # strict FCFS (or priority order): nobody still waiting comes before someone admitted
        last = max(queue_order(s.requests[r]) for r in admitted)
        assert all(queue_order(r) > last for r in s.waiting)
        assert not out.preempted and not s.swapped


@given(scheduler_traces(eos=EOS))
def test_random_traces_respect_budgets_and_every_request_that_fits_finishes(trace):
    config, blocks, requests, tokens = trace
    s = Scheduler(config, BlockManager(**blocks))
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    accepted, ever_running, step_no = [], set(), 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][1][0] <= step_no:
            i, (_, prompt, max_tokens, priority) = pending.pop(0)
            fits = (len(prompt) + max_tokens <= config.max_model_len
                    and s.block_manager.num_blocks_for(len(prompt) + max_tokens) <= blocks["num_blocks"])
            try:
                add(s, f"r{i}", prompt, max_tokens, arrival=i + 100 * step_no, priority=priority)
                accepted.append(f"r{i}")
            except ValueError:
                assert not fits
                continue
            assert fits
        out = s.schedule()
        _check_step(s, out, ever_running)
        ever_running |= {x.request_id for x in out.scheduled}
        token = tokens[step_no % len(tokens)]
        s.update_from_output(out, {x.request_id: token for x in out.scheduled}, eos_token_ids=(EOS,))
        step_no += 1
        assert step_no < 2000, "scheduler stopped making progress"
    for request_id in accepted:
        request = s.requests[request_id]
        assert request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        assert len(request.output_token_ids) <= request.sampling_params.max_tokens
    for pool in (s.block_manager.device, s.block_manager.host):  # no leak
        assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
