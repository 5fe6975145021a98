"""Where the numbers go, and the training loops they come from.

- :mod:`.loggers`: TensorBoard, Weights & Biases or any function, fed by
  :meth:`Tracker.log_to <cockpit_gradnoise.tracking.Tracker.log_to>` after
  every tracked step.
- :mod:`.lightning`: a callback for ``lightning.pytorch.Trainer``.
- :mod:`.huggingface`: a ``transformers.Trainer`` that tracks its steps.

Each module imports its library only when used.
"""
