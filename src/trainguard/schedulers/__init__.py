"""Scheduler adapters: what Slurm and Kubernetes need from a guarded job, and nothing else does.

- ``slurm``: read the allocation (``SLURM_*``) into `trainguard run`'s rendezvous flags; drain an
  excluded node, requeue a job that fell below its minimum, with an exclude list in the run dir.
- ``kubernetes``: the exit-code convention (retryable causes in 128-255) and the one-line verdict
  in ``/dev/termination-log``.
- ``hostlist``: Slurm's compressed host list syntax (``n[1-3,7]``).
- ``adapter``: the `trainguard run` flags and the calls the launcher makes when a node is excluded,
  the job is preempted, or it ends.
"""
