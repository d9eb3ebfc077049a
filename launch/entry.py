"""The ``edgerl`` console script: takes what must be taken before the CLI's imports, then runs it."""

from __future__ import annotations

import signal
import sys


def main() -> int:
    """``edgerl``: :func:`edgerl.launch.cli.main` with this process's arguments.

    ``edgerl robot`` takes SIGUSR1 as the operator's e-stop reset. Its handler can be installed
    only once the CLI is imported (~0.4 s); until then the signal's default action would end the
    process, so it is ignored from the start: a reset sent before any robot runs resets nothing.
    """
    if sys.argv[1:2] == ["robot"]:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    from edgerl.launch.cli import main as cli_main

    return cli_main()
