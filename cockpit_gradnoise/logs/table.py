"""The tidy frame's rows: its columns, as pandas holds them or as NumPy arrays.

Every reader of a log gives the same tidy frame (:data:`COLUMNS`, one row per
number): :func:`tidy_frame` builds it with pandas, and :class:`Rows` holds
the same rows as NumPy arrays, which the command line draws from without
importing pandas (its import was a tenth of ``plot``'s time). pandas is
imported only where a frame is built.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, NamedTuple, Tuple

import numpy

if TYPE_CHECKING:
    import pandas

#: The tidy frame's columns, in order.
COLUMNS = ["step", "quantity", "param", "statistic", "value"]


class Column(NamedTuple):
    """A text column of :class:`Rows`: each row's code into ``categories``, as a pandas
    categorical stores it (``-1``: missing)."""

    codes: numpy.ndarray
    categories: List[str]

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows) -> "Column":
        return Column(self.codes[rows], self.categories)

    @property
    def iloc(self) -> "Column":
        """Itself: its rows are taken by position, as a frame's ``iloc`` takes them."""
        return self

    def unique(self) -> List[str]:
        """The distinct names, in the order they first appear (as ``Series.unique``)."""
        return self.factorize()[1]

    def factorize(self) -> Tuple[numpy.ndarray, List]:
        """``(codes, names)`` as ``Series.factorize`` gives them: codes by first appearance."""
        present, first, inverse = numpy.unique(self.codes, return_index=True,
                                               return_inverse=True)
        order = numpy.argsort(first, kind="stable")  # the present codes by first appearance
        kept = present[order] >= 0  # as pandas: a missing name has code -1, no name
        rank = numpy.full(len(order), -1, dtype=numpy.int64)
        rank[order[kept]] = numpy.arange(int(kept.sum()))
        names = [self.categories[c] for c in present[order][kept].tolist()]
        return rank[inverse.reshape(-1)], names

    def isin(self, names) -> numpy.ndarray:
        """Mask of the rows whose name is one of ``names``."""
        wanted = set(names)
        return numpy.isin(self.codes, [i for i, name in enumerate(self.categories)
                                       if name in wanted])


@dataclass
class Rows:
    """Rows of the tidy frame as NumPy arrays: ``step``, ``value`` and the text
    :class:`Column` s ``quantity``, ``param``, ``statistic``.

    What the dashboard reads of a frame, without pandas: ``rows[mask]``,
    ``rows.iloc[positions]``, ``rows["param"]``, ``len``, ``empty``.
    :meth:`frame` is the pandas frame of the same rows and categories.
    """

    step: numpy.ndarray
    quantity: Column
    param: Column
    statistic: Column
    value: numpy.ndarray

    def __len__(self) -> int:
        return len(self.step)

    def __getitem__(self, rows):
        if isinstance(rows, str):
            return getattr(self, rows)
        return Rows(self.step[rows], self.quantity[rows], self.param[rows],
                    self.statistic[rows], self.value[rows])

    @property
    def iloc(self) -> "Rows":
        """Itself: its rows are taken by position, as a frame's ``iloc`` takes them."""
        return self

    @property
    def empty(self) -> bool:
        return len(self) == 0

    def frame(self) -> "pandas.DataFrame":
        """The pandas frame of these rows, with the same categories."""
        import pandas

        columns = (self.quantity, self.param, self.statistic)
        return tidy_frame(self.step, [c.codes for c in columns],
                          [pandas.Index(c.categories, dtype=str) for c in columns], self.value)


def steps_of(frame) -> numpy.ndarray:
    """The ``step`` column of a frame or :class:`Rows` as a NumPy array."""
    return numpy.asarray(frame.step)


def values_of(frame) -> numpy.ndarray:
    """The ``value`` column of a frame or :class:`Rows` as float64."""
    value = frame.value
    return value if isinstance(value, numpy.ndarray) else value.to_numpy(dtype=float)


def tidy_frame(steps, codes, categories, values) -> "pandas.DataFrame":
    """The tidy frame of these columns: ``step`` and ``value`` arrays, and the text
    columns as codes into their categories (a pandas ``Index`` each)."""
    import pandas

    names = [pandas.Categorical.from_codes(c, categories=k, validate=False)
             for c, k in zip(codes, categories)]
    return pandas.DataFrame(dict(zip(COLUMNS, [steps, *names, values])), copy=False)
