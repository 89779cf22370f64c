"""Prints what the launcher told it about restarts (`TORCHELASTIC_RESTART_COUNT=N`, and
TORCHELASTIC_MAX_RESTARTS), then fails while TORCHELASTIC_RESTART_COUNT is below --fail-until, as
a torchrun script that fails its first attempts would. No torch: the environment is what is checked."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-until", type=int, default=1, help="fail while TORCHELASTIC_RESTART_COUNT is below this")
    args = p.parse_args()
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"TORCHELASTIC_RESTART_COUNT={count} TORCHELASTIC_MAX_RESTARTS={os.environ['TORCHELASTIC_MAX_RESTARTS']}",
          flush=True)
    if count < args.fail_until:
        print(f"failing: restart count {count} is below {args.fail_until}", file=sys.stderr, flush=True)
        sys.exit(3)
    print("done", flush=True)


if __name__ == "__main__":
    main()
