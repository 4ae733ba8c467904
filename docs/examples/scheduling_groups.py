"""Why vLLM evicts a sequence group whole: its sequences share blocks."""

from reference import BlockManager


def two_samples() -> BlockManager:
    """A 10-token prompt forked into two samples that have each written one token."""
    bm = BlockManager(num_blocks=8, block_size=4, num_host_blocks=8)
    bm.allocate("s0", list(range(10)))  # 3 blocks, the last one 2/4 full
    bm.fork("s0", "s1")  # parallel sampling: s1 shares all three
    bm.append_slots("s0", num_computed_tokens=10, num_new_tokens=1)  # copy-on-write
    bm.append_slots("s1", num_computed_tokens=10, num_new_tokens=1)  # now its own
    return bm


def show(name: str, bm: BlockManager) -> None:
    """Block tables (host block ids while swapped out) and what each pool has left."""
    tables = "  ".join(f"{s} {str(bm.block_table(s)):<10}" for s in ("s0", "s1"))
    device_free = bm.device.num_free_blocks
    host_used = bm.host.num_blocks - bm.host.num_free_blocks
    print(f"{name:<23} {tables} device free {device_free}, host used {host_used}")


bm = two_samples()
show("before", bm)
assert bm.device.num_free_blocks == 4  # 4 distinct blocks for 6 logical ones

alone = two_samples()
alone.swap_out(["s1"])  # one sequence: its shared blocks are copied, not freed
show("swap out s1 alone", alone)
assert alone.device.num_free_blocks == 5 and alone.host.num_free_blocks == 5

group = two_samples()
group.swap_out(["s0", "s1"])  # the group: each shared block moves once, stays shared
show("swap out the group", group)
assert group.device.num_free_blocks == 8 and group.host.num_free_blocks == 4

group.swap_in(["s0", "s1"])
show("swap the group back in", group)
alone.swap_in(["s1"])
show("swap s1 back in alone", alone)
assert group.device.num_free_blocks == 4 and alone.device.num_free_blocks == 2
