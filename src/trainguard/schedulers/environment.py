"""The rendezvous configured from what the job's environment says, where the command gives no
``--rdzv-*``/``--master-port``/``--standalone`` (as dlrover-run needs no rendezvous flags).

In this order (the first that applies wins; Slurm's allocation, schedulers/slurm.py, comes before
all of them, and torchrun's own ``PET_*`` variables are flags given):

- ``--hostfile PATH``: one host a line, the first one hosts the c10d store on port 29400;
  ``--nnodes`` left unset is the number of hosts;
- ``MASTER_ADDR`` and ``MASTER_PORT`` (PyTorchJob, Volcano's pytorch plugin, DLRover set them):
  c10d at that endpoint; ``--nnodes`` left unset is ``WORLD_SIZE`` (the number of pods there);
  ``RANK`` 0 hosts the store; the rendezvous id is made from the endpoint, the same on every node;
- Volcano's host files (``/etc/volcano/*.host``, the ones the dns check reads): the first host of
  ``master.host`` (else of the first file) hosts the store; ``--nnodes`` left unset counts them all;
- one node (``--nnodes`` 1, or unset with none of the above): a standalone rendezvous on loopback.

``apply`` returns the line the launch prints: which source configured the rendezvous.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.run import parse_min_max_nnodes

from trainguard.options import SettingsError

HOSTFILE_PORT = 29400  # c10d's usual port
VOLCANO_HOSTFILES = "/etc/volcano/*.host"
PET_RENDEZVOUS = ("PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_STANDALONE")
UNSET_NNODES = "1:1"  # torchrun's default: --nnodes not given


def add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hostfile", default=None, metavar="PATH",
                       help="the job's hosts, one a line: without --rdzv-* flags the first one hosts a c10d "
                       f"rendezvous on port {HOSTFILE_PORT} and --nnodes (when not given) is their number")


STANDALONE = "rendezvous: one node, standalone on 127.0.0.1"  # agent/settings.py's _torchrun_defaults sets it up


@dataclass(frozen=True)
class Found:
    """A rendezvous the environment names."""

    source: str  # what named it, for the console
    endpoint: str  # HOST:PORT of the c10d store
    run_id: str  # the same on every node of the job
    nodes: int  # how many nodes the source knows of (1: it does not say)
    is_host: bool | None = None  # whether this node serves the store; None: torch finds out


def apply(args: argparse.Namespace, env: Mapping[str, str] = os.environ,
          volcano: Callable[[], list[Path]] = lambda: sorted(Path(p) for p in glob.glob(VOLCANO_HOSTFILES))) -> str | None:
    """Fill the rendezvous flags from the environment when none were given; the source, said on
    the console (None: the flags were given, or nothing here applies)."""
    if getattr(args, "slurm_applied", None) is not None:
        return None  # the Slurm allocation filled them (schedulers/slurm.py)
    if any(env.get(name) for name in PET_RENDEZVOUS):
        return "rendezvous from torchrun's PET_* variables (PyTorchJob)"
    if args.standalone or args.rdzv_endpoint or args.rdzv_backend != "static" or args.master_port is not None:
        return None
    unset = str(args.nnodes) == UNSET_NNODES
    found = None if not unset and _max_nodes(args.nnodes) == 1 else find(getattr(args, "hostfile", None), env, volcano)
    if found is not None and unset and found.nodes > 1:
        args.nnodes = str(found.nodes)
    if _max_nodes(args.nnodes) == 1:
        return STANDALONE
    if found is None:
        return None
    args.rdzv_backend, args.rdzv_endpoint = "c10d", found.endpoint
    if args.rdzv_id == "none":
        args.rdzv_id = found.run_id
    if found.is_host is not None and "is_host" not in (args.rdzv_conf or ""):
        is_host = f"is_host={str(found.is_host).lower()}"
        args.rdzv_conf = f"{args.rdzv_conf},{is_host}" if args.rdzv_conf else is_host
    return f"rendezvous from {found.source}: c10d at {found.endpoint}, id {args.rdzv_id}, {args.nnodes} node(s)"


def _max_nodes(nnodes: object) -> int:
    return parse_min_max_nnodes(str(nnodes))[1]


def find(hostfile: str | None, env: Mapping[str, str], volcano: Callable[[], list[Path]]) -> Found | None:
    """The rendezvous the environment names: --hostfile, MASTER_ADDR/MASTER_PORT, Volcano's host
    files, in that order; None: none of them."""
    if hostfile:
        hosts = _hosts(Path(hostfile))
        return _on_host(f"--hostfile {hostfile}", hosts[0], len(hosts))
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return _from_master(env)
    files = volcano()
    if files:
        first = next((f for f in files if f.name == "master.host"), files[0])
        every = sum(len(_hosts(f)) for f in files)
        return _on_host(f"Volcano's {', '.join(str(f) for f in files)}", _hosts(first)[0], every)
    return None


def _hosts(path: Path) -> list[str]:
    """The hosts of a host file: the first word of each line, comments and blank lines skipped
    (an MPI hostfile's ``slots=`` words are its own)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        raise SettingsError(f"cannot read the host file {path}: {exc.strerror or exc}") from None
    hosts = [ln.split("#", 1)[0].split()[0] for ln in lines if ln.split("#", 1)[0].strip()]
    if not hosts:
        raise SettingsError(f"the host file {path} lists no host")
    return hosts


def _on_host(source: str, host: str, nodes: int) -> Found:
    return Found(source, f"{host}:{HOSTFILE_PORT}", _run_id("hosts", host, HOSTFILE_PORT), nodes)


def _from_master(env: Mapping[str, str]) -> Found:
    addr, port = env["MASTER_ADDR"].strip(), env["MASTER_PORT"].strip()
    if not port.isdigit():
        raise SettingsError(f"MASTER_PORT={port!r}: expected a port number")
    world = env.get("WORLD_SIZE", "").strip()
    rank = env.get("RANK", "").strip()
    # The pod of rank 0 is MASTER_ADDR: it serves the store (torch would guess from host names).
    is_host = (rank == "0") if rank.isdigit() else None
    return Found("MASTER_ADDR/MASTER_PORT", f"{addr}:{port}", _run_id("master", addr, int(port)),
                 int(world) if world.isdigit() else 1, is_host)


def _run_id(kind: str, host: str, port: int) -> str:
    """The same on every node of the job (they all read the same endpoint), and a name fit for
    the default run dir."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{kind}-{host}-{port}")
