"""What a single-step quantity declares, checked: its sums' reductions, its methods, its statistic names."""

#: How a declared sum combines across examples of several batches (or processes).
SUM = "sum"  # elementwise addition: sums over examples (tensors of any shape, or scalars)
CAT = "cat"  # concatenation along dimension 0: one row per example
REDUCTIONS = (SUM, CAT)

#: The methods every :class:`~cockpit_gradnoise.ParameterQuantity` implements.
REQUIRED_METHODS = ("network_value", "statistics", "statistic_names")


def check_declarations(cls, base):
    """Raise unless subclass ``cls`` of ``base`` declares valid sums and implements the methods they need.

    Raises:
        TypeError: A reduction not in :data:`REDUCTIONS`, the old ``prepare``
            hook, or a required method left unimplemented.
    """
    bad = {name: how for name, how in cls.sums.items() if how not in REDUCTIONS}
    if bad:
        raise TypeError(f"{cls.__name__}.sums: reductions must be one of {REDUCTIONS}, got {bad}")
    required = list(REQUIRED_METHODS)
    required += ["parameter_sums", "value_from_sums"] if cls.sums else ["parameter_value"]
    if cls.sums and cls.named_value_from_sums is not base.named_value_from_sums:
        required.remove("value_from_sums")  # the value is formed knowing the parameter's name
    if "prepare" in vars(cls):
        raise TypeError(
            f"{cls.__name__}.prepare(global_step, params) is now "
            "step_context(step, params): read info with step.info(key, owner) or "
            "step.loss_batch(owner) (see cockpit_gradnoise.step.Step)"
        )
    missing = [m for m in required if getattr(cls, m) is getattr(base, m)]
    if missing:
        raise TypeError(
            f"{cls.__name__} must implement {', '.join(missing)} "
            "(see cockpit_gradnoise.ParameterQuantity)"
        )


def check_statistic_names(quantity, rows):
    """Raise if ``rows`` (``{name: {statistic: value}}``) hold a statistic ``quantity`` does not declare.

    Raises:
        TypeError: Naming the undeclared statistics.
    """
    declared = set(quantity.statistic_names())
    undeclared = sorted({s for row in rows.values() for s in row} - declared)
    if undeclared:
        raise TypeError(
            f"{type(quantity).__name__}.statistics returned {undeclared}, which "
            "statistic_names() does not list: declare every name it can return"
        )
