"""While a cold server compiles some sizes in the background, the runner pads to the next size whose programs
are all ready, and once a dimension's are all ready it pads no more."""

from jax_engine.runner.staged_sizes import StagedSizes

SIZES = {"tokens": {1, 2, 4, 8, 16}, "rows": {1, 2, 4}}


def test_a_size_is_ready_once_every_program_of_it_is():
    pending = {("step", 2): ("tokens", 2), ("step", 8): ("tokens", 8), ("logits", 2): ("rows", 2),
               ("sample", 2): ("rows", 2)}
    sizes = StagedSizes(SIZES, pending)
    assert [sizes.padded("tokens", n) for n in (1, 2, 4, 8, 16)] == [1, 4, 4, 16, 16]
    assert sizes.padded("rows", 2) == 4 and sizes.padded("blocks", 8) == 8  # a dimension with nothing pending
    assert sizes.padded("tokens", 32) == 32  # above every size: its own, as any shape start-up did not list
    sizes.done(("logits", 2))
    assert sizes.padded("rows", 2) == 4  # the sampler of 2 rows is still compiling
    sizes.done(("sample", 2))
    sizes.done(("step", 8))
    assert sizes.padded("rows", 2) == 2 and sizes.padded("tokens", 8) == 8 and sizes.padded("tokens", 2) == 4
    assert not sizes.complete
    sizes.done(("step", 2))
    sizes.done(("step", 2))  # told twice (a call that loaded it first): no harm
    assert sizes.complete and [sizes.padded("tokens", n) for n in (1, 2, 3)] == [1, 2, 3]


def test_with_nothing_pending_no_size_is_padded():
    sizes = StagedSizes()
    assert sizes.complete and sizes.padded("tokens", 3) == 3
