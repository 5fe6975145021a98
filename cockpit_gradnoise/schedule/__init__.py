"""The adaptive batch schedule: grows the batch through gradient accumulation toward the
critical batch the noise scale estimates, and rescales the learning rate with it.

:mod:`~cockpit_gradnoise.schedule.rule` holds the rule (pure functions of numbers),
:mod:`~cockpit_gradnoise.schedule.batch_schedule` the object the loop consults
(``cgn.BatchSchedule``), which touches the optimizer and the tracker.
"""
