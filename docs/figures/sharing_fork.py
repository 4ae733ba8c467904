"""Parallel sampling after copy-on-write: three samples share the prompt's full blocks.

Drawn from the final state of docs/examples/sharing_fork.py.
"""

from docs.figures._blocks import block_manager_diagram, run_example
from docs.figures._figure import save

fig, ax = block_manager_diagram(run_example("sharing_fork")["bm"])
save(fig, "sharing_fork")
