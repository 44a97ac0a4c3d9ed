"""User-facing errors: one line that names the bad input and the fix; the CLI exits 2."""


class UserError(Exception):
    """Bad input from the user. The CLI prints ``str(err)`` on one line and exits with code 2."""
