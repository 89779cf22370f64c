"""Callbacks for training frameworks: their evaluation and checkpoint-save phases as trainguard
spans, and optional fast checkpoints (``trainguard.checkpoint``) saved and resumed for you.

- ``trainguard.integrations.hf.TrainguardCallback``: a Hugging Face ``transformers.TrainerCallback``
- ``trainguard.integrations.lightning.TrainguardCallback``: a ``lightning.pytorch.Callback``

Importing these modules does not import the framework; using a callback does (ImportError then
if it is not installed). Nothing here is needed for zero-code instrumentation: Step, FP,
DataLoader, Communication and SaveCheckpoint spans come from the automatic hooks either way.
"""
