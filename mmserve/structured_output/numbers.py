"""Numeric bounds as a regex over JSON number text, for engines whose schema translation
ignores them (outlines-core 0.2.14 writes any integer for {"type": "integer", "minimum": 0}).

Exact for integers. For numbers the regex writes no exponent, and a bound that is not a
whole number is moved inward to one (x <= 2.5 becomes x <= 2): both narrowings.
"""

from __future__ import annotations

import math
from typing import Any

_FRACTION = r"(?:\.[0-9]+)?"
_NONZERO_FRACTION = r"\.[0-9]*[1-9][0-9]*"
_ZERO_FRACTION = r"(?:\.0+)?"


def bounds_regex(keywords: dict[str, Any], integer: bool) -> str | None:
    """The regex of the numbers that `keywords`' minimum / maximum / exclusiveMinimum /
    exclusiveMaximum allow; None when none is left (or the bounds are not numbers)."""
    low, low_open = _bound(keywords, "minimum", "exclusiveMinimum", max)
    high, high_open = _bound(keywords, "maximum", "exclusiveMaximum", min)
    if integer:
        lo = None if low is None else (math.floor(low) + 1 if low_open and float(low).is_integer() else math.ceil(low))
        hi = None if high is None else (math.ceil(high) - 1 if high_open and float(high).is_integer() else math.floor(high))
        if lo is not None and hi is not None and lo > hi:
            return None
        return _signed(lo, hi, _integers)
    # inward to whole numbers: a bound that is not one can no longer be reached
    if low is not None and not float(low).is_integer():
        low, low_open = math.ceil(low), False
    if high is not None and not float(high).is_integer():
        high, high_open = math.floor(high), False
    lo, hi = (None if b is None else int(b) for b in (low, high))
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (low_open or high_open))):
        return None
    return _decimals(lo, low_open, hi, high_open)


def _bound(k: dict[str, Any], inclusive: str, exclusive: str, pick: Any) -> tuple[Any, bool]:
    found = [(k[inclusive], False)] if inclusive in k else []
    if exclusive in k:
        found.append((k[exclusive], True))
    if not found:
        return None, False
    value = pick(v for v, _ in found)
    return value, any(v == value and is_open for v, is_open in found)


def _signed(lo: int | None, hi: int | None, positive: Any) -> str:
    """Integers in [lo, hi] (None: unbounded): `positive(a, b)` writes a range of
    non-negative ones."""
    parts = []
    if hi is None or hi >= 0:
        parts.append(positive(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        top = -lo if lo is not None else None
        bottom = max(-hi, 1) if hi is not None else 1
        parts.append("-" + positive(bottom, top))
    return "(?:" + "|".join(parts) + ")"


def _integers(a: int, b: int | None) -> str:
    """Non-negative integers in [a, b] (b None: no upper bound), without leading zeros."""
    if b is None:
        width = len(str(a))
        return f"(?:{_integers(a, 10**width - 1)}|[1-9][0-9]{{{width},}})"
    parts = []
    for width in range(len(str(a)), len(str(b)) + 1):
        lo = a if width == len(str(a)) else 10 ** (width - 1)
        hi = b if width == len(str(b)) else 10**width - 1
        parts.append(_same_width(str(lo), str(hi)))
    return "(?:" + "|".join(parts) + ")"


def _same_width(lo: str, hi: str) -> str:
    """The digit strings of one width from lo to hi. Linear in the width: every full range
    of digits ("00..0" to "99..9") is one class, so only one side recurses at each digit
    (a bound of 1e308 took the recursion to every subrange, out of memory)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo.strip("0") == "" and hi.strip("9") == "":
        return f"[0-9]{{{len(lo)}}}"
    if lo[0] == hi[0]:
        return lo[0] + _same_width(lo[1:], hi[1:])
    rest = len(lo) - 1
    parts = [lo[0] + _same_width(lo[1:], "9" * rest)]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{rest}}}")
    parts.append(hi[0] + _same_width("0" * rest, hi[1:]))
    return "(?:" + "|".join(parts) + ")"


def _decimals(lo: int | None, lo_open: bool, hi: int | None, hi_open: bool) -> str:
    """Numbers x with lo <(=) x <(=) hi (whole bounds or None), without exponent."""
    parts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_open):
        bottom, bottom_open = (lo, lo_open) if lo is not None and lo >= 0 else (0, False)
        parts.append(_non_negative(bottom, bottom_open, hi, hi_open))
    if lo is None or lo < 0:
        top = -lo if lo is not None else None
        bottom = -hi if hi is not None and hi < 0 else 0
        negative = _non_negative(bottom, hi_open and hi is not None and hi <= 0, top, lo_open)
        parts.append("-" + negative if negative else "")
    return "(?:" + "|".join(p for p in parts if p) + ")"


def _non_negative(lo: int, lo_open: bool, hi: int | None, hi_open: bool) -> str:
    """Non-negative numbers x, lo <(=) x <(=) hi."""
    parts = []
    if lo_open:
        parts.append(f"{lo}{_NONZERO_FRACTION}")
        lo += 1
    top = None if hi is None else hi - 1
    if top is None or top >= lo:
        parts.append(_integers(lo, top) + _FRACTION)
    if hi is not None and not hi_open and hi >= lo:
        parts.append(f"{hi}{_ZERO_FRACTION}")
    return "(?:" + "|".join(parts) + ")" if parts else ""
