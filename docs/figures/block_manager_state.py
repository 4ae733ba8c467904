"""A BlockManager's state: block tables, reference counts, the prefix-cache index and the free queue.

Drawn from the final state of docs/examples/block_manager.py.
"""

from docs.figures._blocks import block_manager_diagram, run_example
from docs.figures._figure import save

fig, ax = block_manager_diagram(run_example("block_manager")["bm"])
save(fig, "block_manager_state")
