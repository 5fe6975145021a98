"""The training loops the numbers come from.

- :mod:`.lightning`: a callback for ``lightning.pytorch.Trainer``.
- :mod:`.huggingface`: a ``transformers.Trainer`` that tracks its steps.

Each module imports its library only when used. Where the numbers go (TensorBoard,
Weights & Biases): :mod:`cockpit_gradnoise.logs.loggers`.
"""
