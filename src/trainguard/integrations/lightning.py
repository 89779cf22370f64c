"""Lightning callback: validation and checkpoint-save phases as spans; fast checkpoints.

    from trainguard.integrations.lightning import TrainguardCallback

    trainer = lightning.pytorch.Trainer(..., callbacks=[TrainguardCallback(checkpoint_every=50)])

- Evaluation: a span named ``Evaluation`` per validation run (``on_validation_start`` to
  ``on_validation_end``, the sanity check included); SaveCheckpoint: one span per
  ``trainer.save_checkpoint`` (``ModelCheckpoint`` saves go through it), the ``torch.save`` inside it
  not counted again.
- ``checkpoint_every=N``: every N optimizer steps, this rank's module, optimizer and scheduler
  states and the fit loop's progress go to ``trainguard.checkpoint.save``. On ``on_fit_start`` (after
  the strategy set up the optimizers, where Lightning restores its own checkpoints) the newest
  snapshot every rank has is loaded (``resume=False`` to skip), and training goes on from its step
  (from the middle of an epoch Lightning warns that the data loader is not resumable: the epoch's
  batches start over, as with its own checkpoints).

Step spans need nothing from here: Lightning's optimizer step is timed zero-code.
"""

from __future__ import annotations

from typing import Any

from trainguard.integrations._common import CallbackBase, LazyCallback


def __getattr__(name: str) -> Any:
    if name == "TrainguardCallback":
        return _lazy.get()
    raise AttributeError(name)


def _framework_base() -> type:
    from lightning.pytorch.callbacks import Callback

    return Callback


class _TrainguardCallback(CallbackBase):
    """The behaviour; combined with ``lightning.pytorch.callbacks.Callback`` on first use."""

    def __init__(self, checkpoint_every: int = 0, resume: bool = True) -> None:
        super().__init__(checkpoint_every, resume)
        self._saved_step = -1
        self._unwrap: Any = None

    # ---- save phase: around the trainer's own save ----------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from trainguard.worker import hooks, spans

        rec = spans.recorder()
        if rec is None or self._unwrap is not None:
            return
        original = trainer.save_checkpoint
        trainer.save_checkpoint = hooks.wrap_save(rec, original)  # this trainer only
        self._unwrap = (trainer, original)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._unwrap is not None and self._unwrap[0] is trainer:
            trainer.save_checkpoint = self._unwrap[1]
            self._unwrap = None

    # ---- validation phase ------------------------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.phases.mark()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.phases.evaluation_done()

    # ---- checkpoint ------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not (self.resume and self.checkpoint_every):
            return
        from trainguard import checkpoint

        snap = checkpoint.load_latest()
        if snap is None:
            return
        pl_module.load_state_dict(snap["model"])
        for opt, state in zip(trainer.optimizers, snap.get("optimizers", []), strict=False):
            opt.load_state_dict(state)
        for cfg, state in zip(trainer.lr_scheduler_configs, snap.get("schedulers", []), strict=False):
            cfg.scheduler.load_state_dict(state)
        trainer.fit_loop.load_state_dict(snap["loops"])  # progress: global step, batches, epoch
        self.resumed_from = self._saved_step = int(snap["step"])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if not self.checkpoint_every or step == self._saved_step or step % self.checkpoint_every:
            return  # (with gradient accumulation several batches end at one step)
        from trainguard import checkpoint

        checkpoint.save({
            "model": pl_module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            "loops": trainer.fit_loop.state_dict(),
            "step": step,
        }, step)  # fmt: skip
        self._saved_step = step


_lazy = LazyCallback(_TrainguardCallback, _framework_base, __name__)
