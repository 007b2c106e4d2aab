"""A budget for parsing a file that someone else may have written: the memory (approximate bytes)
and the work (steps) a parse may spend, fixed before it starts, linear in the file's size, and
charged as the parse goes, so that a crafted file is refused at the first overrun instead of after
it has made the process gigabytes larger or busy for minutes.

A parser charges what each step allocates or does (a container made, an item inserted, a string
copied, one node of a tree) and calls nothing else: the budget knows no format. The strict reader
of pickled files (its unpickler, ``unpickler``) charges every opcode it runs; a JSON reader can
charge each node.

Why linear: a legitimate file holds what its parse builds, so its parse allocates a bounded
multiple of its size (the constant is the parser's, measured on real files and documented there).
A crafted file builds far more than it holds (one memoised list copied into a new set by each five
bytes; a million one-byte empty sets), and such a file is exactly one whose parse outgrows any such
multiple.
"""

from __future__ import annotations

from ..core.errors import BudgetError


class Budget:
    """At most ``limit`` units of ``what`` (approximate bytes of memory, or steps of work, or one of
    them standing for both: the parser says) for reading ``source``.

    ``charge(units)`` adds to ``used``, and raises ``BudgetError`` (a ``CheckpointError``) at the
    first charge that takes ``used`` past ``limit``, before the parser does what it charged for.
    """

    __slots__ = ("limit", "used", "source", "what", "_basis")

    def __init__(self, limit: int, source: str, what: str = "bytes of memory and steps of work") -> None:
        if type(limit) is not int or limit < 0:
            raise ValueError(f"a budget's limit is a non-negative integer, not {limit!r}")
        self.limit, self.used, self.source, self.what = limit, 0, source, what
        self._basis = ""

    @classmethod
    def linear(cls, nbytes: int, source: str, *, per_byte: int, floor: int,
               what: str = "bytes of memory and steps of work", counted: str = "its size") -> Budget:
        """A budget of ``per_byte * nbytes + floor`` units for ``nbytes`` bytes of input (``counted``
        says which, in the message: ``"its pickle"``): what a legitimate file of that size can need
        (``per_byte`` a multiple of what real files use a byte; ``floor`` what the parse of a tiny
        file may take, small enough to allocate at once)."""
        if not all(type(n) is int and n >= 0 for n in (nbytes, per_byte, floor)):
            raise ValueError(f"a linear budget is of non-negative integers, not {nbytes!r} bytes x {per_byte!r} + "
                             f"{floor!r}")
        budget = cls(per_byte * nbytes + floor, source, what)
        budget._basis = f" ({per_byte} per byte of {counted}, {nbytes:,} bytes, plus {floor:,})"
        return budget

    @property
    def left(self) -> int:
        """The units not yet charged."""
        return self.limit - self.used

    def charge(self, units: int) -> None:
        """Add ``units`` (>= 0) to what the parse used.

        Raises:
            BudgetError: the total now exceeds ``limit``; naming the source file.
        """
        self.used += units
        if self.used > self.limit:
            raise BudgetError(
                f"{self.source} asks for more than {self.limit:,} {self.what} while it is read{self._basis}: more "
                f"than any file of its size that torch or nxd_smp writes needs, so it is a crafted or damaged file, "
                f"refused before it grows further. Do not load it; if torch or nxd_smp wrote it, report it with the "
                f"file.")
