"""What the agent's console shows: trainguard's own lines (and the workers' output unless --quiet).

torch's launcher logs through loggers that carry their own stderr handlers (``torch`` and
``torch.distributed``, set up by ``torch._logging``), so its OMP_NUM_THREADS banner and its own
"failed (exitcode: 1) local_rank: 0" line reached the console even with --quiet, and contradicted
trainguard's account of the same failure. Here those loggers lose their stream handlers and
propagate to the root logger, whose file handler writes them to the agent log.
"""

from __future__ import annotations

import logging


def route_torch_logging() -> None:
    for name in [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # a FileHandler someone added stays
                logger.removeHandler(handler)
        logger.propagate = True


class ConsoleFilter(logging.Filter):
    """trainguard's lines only; everything else (torch's included) is in the agent log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("trainguard") and not record.name.startswith("trainguard.worker_output")
