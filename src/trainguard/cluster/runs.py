"""One run of a run directory: its id and its first attempt number, agreed by every node.

Users resume by running again into the same run dir (its checkpoints are shared by every run), so a
run dir holds several runs. Each run's attempts continue the numbering of the dir
(``logs/attempt-<n>``): a new run never writes into a log directory an earlier run wrote, and the
diagnosis of a failure reads only this run's lines.

The first agent to get there proposes a run (a fresh id, and the attempt after the highest
``logs/attempt-<n>`` it finds); ``compare_set`` on the rendezvous store makes every node take the
same one, nodes that join in a later round included. Stores without ``compare_set`` (torch's
``EtcdStore`` of an etcd rendezvous) agree through ``add``: the first to count 1 writes its proposal,
the others wait for it. The scan happens before any worker of the new run starts (workers start
after the rendezvous), so whichever node's proposal wins, its first attempt is past every
directory an earlier run wrote. A node that already belongs to a run keeps it in later rounds.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainguard.cluster import exchange

log = logging.getLogger(__name__)

RUN_KEY = "trainguard/run"
_ATTEMPT_DIR = re.compile(r"attempt-(\d+)")


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    first_attempt: int  # this run's attempts are first_attempt, first_attempt + 1, ...

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RunInfo:
        d = json.loads(text)
        return cls(str(d["run_id"]), int(d["first_attempt"]))


def next_attempt(run_dir: Path) -> int:
    """The attempt number after every ``logs/attempt-<n>`` in the run dir (0 in a fresh one)."""
    highest = -1
    try:
        for p in (Path(run_dir) / "logs").iterdir():
            m = _ATTEMPT_DIR.fullmatch(p.name)
            if m:
                highest = max(highest, int(m.group(1)))
    except OSError:  # no logs/ yet
        pass
    return highest + 1


def propose(run_dir: Path) -> RunInfo:
    return RunInfo(time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3), next_attempt(run_dir))


def agree(store: Any, run_dir: Path, mine: RunInfo | None, job: str = "") -> RunInfo:
    """The run this node belongs to, agreed through the rendezvous store (``mine``: the run it
    already belongs to, kept; ``job``: the rendezvous id). ``store`` is the rendezvous' store under
    the rounds' prefixes (``torch_compat.rendezvous_base_store``), so a node that joins in a later
    round gets the run the first round agreed on, not one of its own. Without a store that answers,
    the node's own proposal."""
    offer = mine or propose(run_dir)
    if store is None:
        return offer
    key = f"{RUN_KEY}/{job}"
    try:
        agreed = RunInfo.from_json(exchange.first_writer(store, key, offer.to_json())[1])
    except Exception as exc:  # the store is gone or refuses: the scan alone keeps runs apart
        log.info("run id not agreed through the store (%s): using this node's own", exc)
        return offer
    return mine or agreed

