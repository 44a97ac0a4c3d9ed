"""User-facing errors: one line that names the bad input and the fix; the CLI exits 2."""


class UserError(Exception):
    """Bad input from the user. The CLI prints ``str(err)`` on one line and exits with code 2."""


def check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    """A UserError naming ``what`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise UserError(f"{what}={value!r} is not valid: use one of {', '.join(choices)}")


def check_positive(what: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise UserError(f"{what}={value} must be at least {minimum}")


def check_number(what: str, value: float, low: float | None = None, high: float | None = None,
                 open_low: bool = False, hint: str = "") -> None:
    """A UserError naming ``what`` unless ``value`` is finite and within ``[low, high]`` (``(low, high]`` with
    ``open_low``): inf and NaN from the command line are bad input, and bounds keep a huge value from hanging."""
    import math

    below = low is not None and (value <= low if open_low else value < low)
    if not math.isfinite(value) or below or (high is not None and value > high):
        lo = "" if low is None else f"{'>' if open_low else '>='} {low:g}"
        hi = "" if high is None else f"<= {high:g}"
        rng = " and ".join(x for x in (lo, hi) if x)
        raise UserError(f"{what} {value}: use a finite number{' ' + rng if rng else ''}{hint}")
