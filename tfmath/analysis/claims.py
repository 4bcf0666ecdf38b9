"""The seeds' quantitative claims beside what tfmath measures, and a verdict on each.

A :class:`Claim` holds what a seed text says (its value as printed, say
``"0.78"`` or ``"110M"``), what tfmath computed, with an interval where the
measurement has one, and how the two are compared. Its :attr:`Claim.verdict`
is one of :data:`VERDICTS`:

``"holds"``
    The seed's value lies inside the measured interval, or equals the
    computed value up to ``tolerance``: floating-point rounding, or a stated
    slack (the lower-order terms left in an exponent read from a count).
``"holds within the seed's rounding"``
    Not exact, but the printed value is the computed value rounded to the
    digits printed: within half a unit of the last printed digit. A whole
    number's trailing zeros are not significant, so ``"110M"`` stands for
    105M to 115M and ``"0.78"`` for 0.775 to 0.785.
``"wrong"``
    Neither; :attr:`Claim.correct_value` prints the computed value with the
    seed's digits.
``"differs"``
    For a claim measured in another setting than tfmath's (``elsewhere=True``:
    Kaplan et al.'s exponents, fitted to models a thousand times larger on
    other text), the measured interval excludes the seed's value: tfmath's
    runs give another value, which does not make the seed's wrong.
``"not computed"``
    tfmath cannot compute it; :attr:`Claim.reason` says why.

Claims that state an exact law (``Var(q·k) = d_k``) set ``exact=True``: only
the interval or the floating-point tolerance can make them hold.
"""

import math
import re
from dataclasses import dataclass

from tfmath._contract.checks import choice, real
from tfmath.errors import ArgumentError, DTypeError

__all__ = [
    "DIFFERS",
    "HOLDS",
    "NOT_COMPUTED",
    "ROUNDED",
    "VERDICTS",
    "WRONG",
    "Claim",
    "parse_printed",
]

HOLDS = "holds"
ROUNDED = "holds within the seed's rounding"
WRONG = "wrong"
DIFFERS = "differs"
NOT_COMPUTED = "not computed"
#: Every verdict, from best to worst.
VERDICTS = (HOLDS, ROUNDED, WRONG, DIFFERS, NOT_COMPUTED)
#: How the measured value is compared with the seed's: equal, at most, at least, greater than.
RELATIONS = ("=", "<=", ">=", ">")

_SCALES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_PRINTED = re.compile(r"^(?P<sign>-?)(?P<whole>\d+)(?:\.(?P<fraction>\d+))?(?P<suffix>[KMBT]?)$")


def parse_printed(printed):
    """The value a printed number stands for, and the unit of its last significant digit.

    Parameters
    ----------
    printed : str
        A number as a seed prints it: digits with an optional sign, decimal
        fraction and magnitude suffix K, M, B or T (``"0.78"``, ``"-1"``,
        ``"110M"``, ``"175B"``).

    Returns
    -------
    value : float
    unit : float
        The place value of the last significant digit: ``0.01`` for ``"0.78"``,
        ``1e7`` for ``"110M"`` (a whole number's trailing zeros are not
        significant), ``1.0`` for ``"0"``.

    Examples
    --------
    >>> from tfmath.analysis.claims import parse_printed
    >>> parse_printed("0.78")
    (0.78, 0.01)
    >>> parse_printed("110M")
    (110000000.0, 10000000.0)
    """
    if not isinstance(printed, str):
        raise DTypeError(f"printed must be a string, got {type(printed).__name__} {printed!r}")
    match = _PRINTED.match(printed.strip())
    if match is None:
        raise ArgumentError(f"printed must be a number such as '0.78' or '110M', got {printed!r}")
    whole, fraction, suffix = match["whole"], match["fraction"], match["suffix"]
    scale = _SCALES[suffix]
    value = float(f"{match['sign']}{whole}.{fraction or 0}") * scale
    if fraction is not None:
        exponent = -len(fraction)
    elif whole.strip("0"):
        exponent = len(whole) - len(whole.rstrip("0"))
    else:
        exponent = 0
    return value, 10.0**exponent * scale


def _format_like(printed, value):
    """``value`` printed with the digits of ``printed`` (``"0.77"`` for 0.7679 like ``"0.78"``)."""
    _, unit = parse_printed(printed)
    suffix = printed.strip()[-1] if printed.strip()[-1] in "KMBT" else ""
    scaled_unit = unit / _SCALES[suffix]
    decimals = max(0, -round(math.log10(scaled_unit)))
    rounded = round(value / unit) * unit / _SCALES[suffix]
    return f"{rounded:.{decimals}f}{suffix}"


@dataclass(frozen=True)
class Claim:
    """One quantitative claim of a seed text, with tfmath's measurement of it.

    Attributes
    ----------
    seed : str
        The seed text, by its number (``"000"`` to ``"004"``).
    statement : str
        What the seed says, in words.
    printed : str
        The seed's value as printed (see :func:`parse_printed`).
    measured : float or None
        What tfmath computed; None for a claim it cannot compute.
    interval : tuple of float, optional
        A confidence interval of the measurement, low and high.
    relation : {"=", "<=", ">=", ">"}
        The claim is that the true value equals the printed one, is at most
        it, at least it, or greater than it. For a bound the whole interval
        must satisfy it, up to ``tolerance`` (none for ``">"``).
    exact : bool
        The seed states an exact law rather than a rounded number, so
        rounding cannot make it hold.
    tolerance : float
        Absolute floating-point slack within which equality holds.
    section : str, optional
        The report section (experiment name) that computes it; the report
        fills it in from the experiment that returned the claim.
    reason : str
        Why tfmath cannot compute it (only when ``measured`` is None), or a
        note on how it was measured.
    elsewhere : bool
        The seed's value was measured in a setting tfmath does not reproduce
        (other data, other scales): a value outside the interval "differs"
        rather than being "wrong".
    """

    seed: str
    statement: str
    printed: str
    measured: float | None
    interval: tuple | None = None
    relation: str = "="
    exact: bool = False
    tolerance: float = 1e-9
    section: str | None = None
    reason: str = ""
    elsewhere: bool = False

    def __post_init__(self):
        parse_printed(self.printed)
        choice("relation", self.relation, RELATIONS)
        real("tolerance", self.tolerance, at_least=0.0)
        if self.measured is None:
            if not self.reason:
                raise ArgumentError("a claim without a measured value needs a reason")
            return
        object.__setattr__(self, "measured", real("measured", self.measured))
        if self.interval is not None:
            low, high = (real("interval", bound) for bound in self.interval)
            if not low <= high:
                raise ArgumentError(
                    f"interval must be (low, high) with low <= high, got {self.interval}"
                )
            object.__setattr__(self, "interval", (low, high))

    @property
    def seed_value(self):
        """The number the seed prints, as a float."""
        return parse_printed(self.printed)[0]

    @property
    def verdict(self):
        """One of :data:`VERDICTS` (see the module's description)."""
        if self.measured is None:
            return NOT_COMPUTED
        value, unit = parse_printed(self.printed)
        low, high = self.interval or (self.measured, self.measured)
        if self.relation == "<=":
            return HOLDS if high <= value + self.tolerance else WRONG
        if self.relation == ">=":
            return HOLDS if low >= value - self.tolerance else WRONG
        if self.relation == ">":
            return HOLDS if low > value else WRONG
        if low - self.tolerance <= value <= high + self.tolerance:
            return HOLDS
        # A relative margin so that a value exactly on the rounding boundary counts.
        if not self.exact and abs(self.measured - value) <= unit / 2 * (1 + 1e-9):
            return ROUNDED
        return DIFFERS if self.elsewhere else WRONG

    @property
    def correct_value(self):
        """For a wrong claim, the computed value with the seed's digits; else ``""``."""
        if self.verdict != WRONG:
            return ""
        if self.relation != "=" or self.exact:
            return f"{self.measured:.6g}"
        return _format_like(self.printed, self.measured)

    def as_dict(self):
        """The claim as plain values, for CSV and JSON."""
        low, high = self.interval or (None, None)
        return {
            "seed": self.seed,
            "statement": self.statement,
            "seed_value": self.printed,
            "relation": self.relation,
            "measured": self.measured,
            "interval_low": low,
            "interval_high": high,
            "verdict": self.verdict,
            "correct_value": self.correct_value,
            "section": self.section or "",
            "note": self.reason,
        }
