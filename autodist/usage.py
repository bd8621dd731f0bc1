"""Option values out of range, reported as usage errors of the ``autodist`` command line.

argparse exits with status 2 on a value that does not parse. A value that parses
but is out of range is the same mistake, found later, by the library function
that takes it and raises ``ValueError``; a subcommand checks its options inside
:func:`options_checked`, before it starts any work, and ``cli.main`` hands the
resulting :class:`UsageError` to the subcommand's parser, which prints its usage
and the message and exits with status 2.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class UsageError(ValueError):
    """An option value the command line refuses (exit status 2)."""


@contextlib.contextmanager
def options_checked() -> Iterator[None]:
    """Turns a ``ValueError`` raised in the block into a :class:`UsageError`."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err
