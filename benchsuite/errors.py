"""User-facing errors: each becomes one line on stderr and a non-zero exit, never a traceback."""


class UserError(Exception):
    """Bad input from the user (matrix, paths, ports, flags). Exit status 2."""

    exit_code = 2


class RunError(Exception):
    """A run could not continue (engine failed to build or start, store unwritable). Exit status 1."""

    exit_code = 1
