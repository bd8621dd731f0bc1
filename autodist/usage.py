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
import os
import tempfile
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


def check_output_path(path: str, option: str) -> None:
    """Raises ``ValueError`` when ``path`` could not be written, so that a command
    says so before its slow part rather than after it.

    Args:
        option: the option that named it, for the message (``--out``).
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory; give the path of a file.")
    if not os.path.isdir(directory):
        raise ValueError(f"{option} {path}: its directory {directory} does not exist.")
    if not os.access(directory, os.W_OK) or (os.path.exists(path)
                                             and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {path} is not writable.")
    # access() says nothing of names (one too long for the temporary sibling the
    # commands write first, say): make such a sibling.
    try:
        handle, sibling = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    except OSError as err:
        raise ValueError(f"{option} {path} cannot be written: making a file beside it "
                         f"failed ({err.strerror}).") from None
    os.close(handle)
    os.remove(sibling)
