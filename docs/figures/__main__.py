"""`python -m docs.figures [--out DIR]`: run every figure script (what `make figures` does)."""

import subprocess
import sys

from docs.figures._figure import scripts

for script in scripts():
    module = f"docs.figures.{script.stem}"
    print(f"{module} ...", flush=True)
    subprocess.run([sys.executable, "-m", module, *sys.argv[1:]], check=True)
