"""trainguard: keep distributed PyTorch training alive.

Optional in-script API (everything also works with no code change under ``trainguard run``):
``trainguard.span(name)``, ``trainguard.step()`` and ``trainguard.checkpoint``.
"""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import trainguard` in a worker costs nothing until used.
    if name in ("span", "step"):
        from trainguard.worker import spans

        return getattr(spans, name)
    if name == "checkpoint":
        import importlib

        return importlib.import_module("trainguard.checkpoint")
    raise AttributeError(name)
