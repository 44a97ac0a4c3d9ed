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
