"""Looking at a job: the run directory read back (events, spans, reports), folded into one summary
that the metrics, ``trainguard status``, ``trainguard trace`` and the dashboard all show."""
