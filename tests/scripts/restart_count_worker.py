"""Prints what the launcher told it about restarts (`TORCHELASTIC_RESTART_COUNT=N`, and
TORCHELASTIC_MAX_RESTARTS), then fails while TORCHELASTIC_RESTART_COUNT is below --fail-until, as
a torchrun script that fails its first attempts would. Without --gloo no torch: the environment is
what is checked; --gloo joins a gloo process group first and ends with a barrier, so that the ranks of
several nodes fail and finish together, as a training job's do."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-until", type=int, default=1, help="fail while TORCHELASTIC_RESTART_COUNT is below this")
    p.add_argument("--gloo", action="store_true", help="a gloo process group: ranks fail and finish together")
    args = p.parse_args()
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"TORCHELASTIC_RESTART_COUNT={count} TORCHELASTIC_MAX_RESTARTS={os.environ['TORCHELASTIC_MAX_RESTARTS']}",
          flush=True)
    if args.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # every rank is here before any fails
    if count < args.fail_until:
        print(f"failing: restart count {count} is below {args.fail_until}", file=sys.stderr, flush=True)
        sys.exit(3)
    if args.gloo:
        dist.barrier()  # no rank finishes before all of them made it
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
