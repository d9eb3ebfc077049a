"""The ``edgerl`` console script: takes what must be taken before the CLI's imports, then runs it."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from typing import Any, TextIO

#: What a write meets where the stream's reader has gone: a pipe without reader, or a terminal
#: that hung up (an SSH session that dropped).
READER_GONE = (errno.EPIPE, errno.EIO)


class ReaderSafe:
    """A command's stdout or stderr whose reader may go away (``edgerl robot | head``, a ``tee``
    or a log shipper that ends, a terminal that hangs up): the first write that finds it gone
    sends the stream, and what it held, to /dev/null, and the command goes on. Before, ``print``
    raised ``BrokenPipeError`` there: ``edgerl robot`` ended its robots' run at its next status
    line with ``edgerl: error: [Errno 32] Broken pipe``, and ``rollout``, ``train`` and the
    benches wrote no ``--json`` file. Everything else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._to_null(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._to_null(exc)

    def _to_null(self, exc: OSError) -> None:
        if exc.errno not in READER_GONE:  # a full disk under a redirect, say: the command's to report
            raise exc
        self.reader_gone = True
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())  # the process's descriptor: every writer of it
        finally:
            os.close(null)
        with contextlib.suppress(OSError):
            self._stream.flush()  # what it held goes to /dev/null

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main() -> int:
    """``edgerl``: :func:`edgerl.launch.cli.main` with this process's arguments, its stdout and
    stderr :class:`ReaderSafe`.

    ``edgerl robot`` takes SIGUSR1 as the operator's e-stop reset. Its handler can be installed
    only once the CLI is imported (~0.4 s); until then the signal's default action would end the
    process, so it is ignored from the start: a reset sent before any robot runs resets nothing.
    """
    if sys.argv[1:2] == ["robot"]:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None:
            setattr(sys, name, ReaderSafe(stream))
    from edgerl.launch.cli import main as cli_main

    return cli_main()
