"""Beam search over a block manager: beams fork, share their past, and are pruned."""

import itertools

import numpy as np

from jax_engine.loader import load_checkpoint
from reference import BlockManager, LlamaModel, beam_search
from reference.beam_search import log_softmax

checkpoint = load_checkpoint()  # the default model, SmolLM2-135M-Instruct
model = LlamaModel(checkpoint.config, checkpoint.weights)
tokenizer = checkpoint.tokenizer
prompt = tokenizer.encode("The sea is")
width, steps = 3, 4
bm = BlockManager(num_blocks=32, block_size=2)
bm.allocate("beam0", prompt)
beams = {"beam0": (prompt, 0.0)}  # name -> (tokens, cumulative log-probability)
names = (f"beam{i}" for i in itertools.count(1))
history = []  # per step: (child, parent, token) of every survivor, for the diagram

for step in range(1, steps + 1):
    proposals = []  # vLLM's rule: each beam proposes its 2 x width most likely tokens
    for name, (tokens, cum) in beams.items():
        logprobs = log_softmax(model.last_logits(tokens).astype(np.float64))
        for token in np.argsort(-logprobs, kind="stable")[: 2 * width]:
            proposals.append((cum + logprobs[token], name, int(token)))
    survivors = sorted(proposals, key=lambda p: p[0], reverse=True)[:width]
    # A beam's first survivor continues it in place; the others fork it. Every fork
    # happens before anyone writes, so a child starts from its parent's blocks.
    plan, kept = [], set()
    for cum, parent, token in survivors:
        child = parent if parent not in kept else next(names)
        if parent in kept:
            bm.fork(parent, child)
        kept.add(parent)
        plan.append((child, parent, token, cum))
    for name in beams.keys() - kept:
        bm.free(name)  # pruned: its blocks lose a holder
    new_beams = {}
    for child, parent, token, cum in plan:
        tokens = beams[parent][0]
        bm.append_slots(child, len(tokens), 1)  # copies its last block if shared
        new_beams[child] = (tokens + [token], cum)
    beams = new_beams
    history.append([(child, parent, token) for child, parent, token, _ in plan])

    tables = {name: bm.block_table(name) for name in beams}
    held = len({b for table in tables.values() for b in table})
    listed = sum(len(table) for table in tables.values())
    print(f"step {step}: {held} blocks held for {listed} table entries")
    for name, (tokens, cum) in beams.items():
        text = tokenizer.decode(tokens[len(prompt):])
        print(f"  {name:<6}{text!r:<28}{cum:7.2f}  {tables[name]}")

expected = beam_search(model, prompt, beam_width=width, max_tokens=steps)
assert [tokens for tokens, _ in beams.values()] == [tokens for tokens, _ in expected]
