"""`tgdemo-wrap ARGS`: a launcher-style wrapper around `python -m tgdemo.cli ARGS`.

Rank 0 replaces itself with it (exec, as shell-style wrappers do); other ranks start it as a child
and wait (as `accelerate launch` does with one process).
"""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> None:
    argv = [sys.executable, "-m", "tgdemo.cli", *sys.argv[1:]]
    print(f"wrapper pid={os.getpid()} rank={os.environ['RANK']}", flush=True)
    if os.environ["RANK"] == "0":
        os.execv(sys.executable, argv)
    sys.exit(subprocess.call(argv))
