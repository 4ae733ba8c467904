"""Prefix caching: requests whose prompts start alike share the blocks found by hash.

Drawn from the final state of docs/examples/sharing_prefix.py.
"""

from docs.figures._blocks import block_manager_diagram, run_example
from docs.figures._figure import save

fig, ax = block_manager_diagram(run_example("sharing_prefix")["bm"])
save(fig, "sharing_prefix")
