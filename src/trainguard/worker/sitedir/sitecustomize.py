"""trainguard's ``sitecustomize``: zero-code instrumentation of every Python process a job starts.

``trainguard run`` puts this file's directory first on the workers' PYTHONPATH (the route
``opentelemetry-instrument`` and ``ddtrace-run`` take), so Python runs it at startup in console
scripts (``--no-python llamafactory-cli ...``), ``python -m`` modules and wrappers that exec or
spawn Python — processes that never pass through trainguard's worker entry. It:

1. runs the ``sitecustomize`` this one hides (the next one on ``sys.path``: a distribution's or
   the user's), as Python would have, and makes it the module ``import sitecustomize`` returns;
2. installs ``trainguard.worker.bootstrap`` — which does nothing outside a job's workers (no ring
   prefix in the environment), nothing twice, and nothing in processes that are not the rank's
   trainer (see the bootstrap). trainguard is taken from the installation this file belongs to,
   so the worker and the agent speak the same ring layout even when the job's interpreter is
   another environment.

Nothing here may stop the process: every failure is one line on stderr.
"""

import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # what site.py does with a failing sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}", file=sys.stderr)


def _trainguard() -> None:
    """Import this installation's trainguard package (by path when the interpreter finds another)."""
    import importlib.util

    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = importlib.util.find_spec("trainguard")
    if found is not None and found.origin and os.path.dirname(os.path.abspath(found.origin)) == pkg:
        return
    spec = importlib.util.spec_from_file_location(
        "trainguard", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trainguard"] = module
    spec.loader.exec_module(module)


def _instrument() -> None:
    if not os.environ.get("TRAINGUARD_RING_PREFIX"):  # bootstrap.ENV_RING_PREFIX
        return  # not a trainguard worker: cost nothing
    try:
        _trainguard()
        from trainguard.worker import bootstrap

        bootstrap.install()
    except Exception as exc:
        print(f"trainguard: instrumentation disabled: {exc}", file=sys.stderr, flush=True)


_chain()
_instrument()
