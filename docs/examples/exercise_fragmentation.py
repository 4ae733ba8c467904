"""Answers to page 2's exercises, computed by the reference's own accounting."""

from reference import BlockManager
from reference.tutorial.kv_memory import first_fit_steps, paged_usage

# 1. A request of 40 prompt tokens that will write 25: how many slots does each
#    policy hold for it at the end? (paging: 16-token blocks)
prompt, output = 40, 25
bm = BlockManager(num_blocks=8, block_size=16)
bm.allocate("r", list(range(prompt + output)))
held = {"Max": 2048, "Pow2": prompt + (1 << (output - 1).bit_length()),
        "Oracle": prompt + output, "paged": len(bm.block_table("r")) * 16}
print("1.", ", ".join(f"{name} {slots}" for name, slots in held.items()))

# 2. Over that request's life, what share of the slots it holds does paging
#    leave empty, with blocks of 16 and of 64 tokens?
for block_size in (16, 64):
    u = paged_usage([(prompt, output)], block_size)
    print(f"2. blocks of {block_size}: {u.internal_fragmentation / u.total:.1%} empty")

# 3. The figure's trace with exact (Oracle) reservations instead of Pow2: in how
#    many steps does a request wait?
trace = [(4, 3), (3, 5), (3, 5), (2, 3), (2, 2)]
exact = [p + o for p, o in trace]
waits = sum(waiting > 0 for _, waiting in first_fit_steps(trace, exact, 32))
print(f"3. {waits} steps with a request waiting; reservations: {exact}")
