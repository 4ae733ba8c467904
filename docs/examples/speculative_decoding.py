"""Speculative decoding in the reference engine: n-gram drafts, verified in one step."""

from reference import ReferenceEngine, SamplingParams
from reference.speculative import NgramProposer
from reference.tutorial.tiny_llama import tiny_llama  # 2 layers, 4 heads, 32 tokens

PROMPT = [1, 4, 3, 3, 3, 4, 4, 4]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(proposer: NgramProposer | None) -> tuple[ReferenceEngine, list[dict]]:
    """Complete PROMPT; one record per step: its drafts, what it emitted, the blocks."""
    engine = ReferenceEngine(tiny_llama(), num_blocks=8, block_size=4,
                             proposer=proposer)
    engine.add_request("a", PROMPT, GREEDY)
    request, bm = engine.scheduler.requests["a"], engine.block_manager
    steps = []
    while engine.has_unfinished_requests():
        record = dict(tokens=request.token_ids, drafts=list(request.spec_token_ids),
                      computed=request.num_computed_tokens)
        num_output = len(request.output_token_ids)
        engine.step()
        [scheduled] = engine.trace[-1].scheduled  # the block table the step wrote to
        record |= dict(new=scheduled.num_new_tokens, table=scheduled.block_table,
                       emitted=request.output_token_ids[num_output:],
                       after=bm.block_table("a") if "a" in bm.block_tables else [],
                       computed_after=request.num_computed_tokens,
                       cached=sorted(bm.device.cached_blocks.values()),
                       hashes={b.block_id: b.block_hash for b in bm.device.blocks},
                       free=list(bm.device.free_queue))
        steps.append(record)
    return engine, steps


# Prompt lookup: up to 4 drafts, copied after the longest earlier match of 3 to 1 tokens
engine, steps = run(NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=3))
plain, plain_steps = run(None)
row = "{:>4} {:>3}  {:<8} {:<7} {:<15} {:<15} {:>8}  {}"
print(row.format("step", "new", "drafts", "emitted", "table in step", "table after",
                 "computed", "cached"))
for i, s in enumerate(steps, 1):
    words = [" ".join(map(str, s[key])) or "-" for key in ("drafts", "emitted")]
    after, computed = str(s["after"]), s["computed_after"]
    if not s["after"]:  # finished: every block was freed
        after, computed = "freed", "-"
    print(row.format(i, s["new"], *words, str(s["table"]), after, computed,
                     s["cached"]))
output = engine.scheduler.requests["a"].output_token_ids
assert output == plain.scheduler.requests["a"].output_token_ids  # greedy is unchanged
print(f"{len(steps)} steps instead of {len(plain_steps)} for the same "
      f"{len(output)} tokens: {output}")
print(f"drafts verified {engine.num_draft_tokens}, "
      f"accepted {engine.num_accepted_tokens}")
