"""The worker's side of the Flight Recorder probe (``probes/flight_recorder.py``): torch's
``_WorkerServer`` on a unix socket beside the rank's ring, started when torch is imported.

Its handlers are torch's own and run on the server's C++ thread, so they answer while the main
thread is blocked in a collective. The socket is made with mode 0600 (only the user's processes
may ask; one handler runs py-spy). torch prints a line when the server starts and three when it is
destroyed; neither is the user's business: the start is made with stderr pointed away (nothing
else runs yet at that moment: this is the import of torch), and the server is never destroyed (the
process's end closes its socket; the agent removes the file with the rings).

``torch._C._distributed_c10d._WorkerServer(path)`` is private; checked on torch 2.13 and 2.14
(torch_compat.CHECKED_ON; tests/test_flight_recorder.py under bench/compat.sh). A torch without
it: ``start`` says why in one line and the probe's view of that rank carries the reason instead.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

_server: Any = None


def socket_path(ring_path: str) -> str:
    """Where a worker serves its recorder: beside its ring (``worker.ring.ring_path``)."""
    return ring_path + ".fr"


def start(path: str) -> str | None:
    """Serve this process's recorder at ``path``; None when done, else why not (one line)."""
    global _server
    if _server is not None:
        return None
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError as exc:  # a torch built without distributed
        return f"no torch worker server: {exc}"
    try:
        os.unlink(path)  # a stale socket of an earlier process with this name (never another user's: 0600, sticky dir)
    except OSError:
        pass
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    umask = os.umask(0o177)
    try:
        os.dup2(null, 2)
        server = _WorkerServer(path)
    except Exception as exc:
        return f"flight recorder socket {path}: {exc}"
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
        os.umask(umask)
    # Never destroyed: its destructor prints to the user's stderr at the interpreter's exit.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(server))
    _server = server
    return None

