"""User-facing errors: each becomes one line on stderr and a non-zero exit, never a traceback."""


class UserError(Exception):
    """Bad input from the user (matrix, paths, ports, flags). Exit status 2."""

    exit_code = 2


class RunError(Exception):
    """A run could not continue (engine failed to build or start, store unwritable). Exit status 1."""

    exit_code = 1


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt lies anywhere in the exception's chain (causes and contexts).
    Ctrl-C while a C extension initializes (scipy's HiGHS module, imported by `benchsuite report`)
    reaches Python as "ImportError: initialization failed" raised from the KeyboardInterrupt: an
    interrupt all the same, which the command reports as one (exit 130), not as a crash."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return False
