"""A run's files (config, metrics, TensorBoard, checkpoints, summary): a write that fails is one
error naming the file and the system's reason, not a traceback.

A full disk once ended ``edgerl train`` with TensorBoard's writer thread printing a traceback and
``torch.save`` raising ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos``
over two more, its half-written checkpoint left behind as ``ckpt-*.tmp``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from edgerl.robot_client import errors

log = logging.getLogger(__name__)


class RunFilesError(Exception):
    """A file of a run could not be written (a full disk, a folder made read-only). The run
    stops; its last checkpoint stands (a checkpoint is written under a temporary name first)."""


def os_error(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, or one it was raised from or while handling
    (``torch.save`` reports a failed write as a ``RuntimeError`` raised over it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Raise a failed write within as :class:`RunFilesError` naming ``path``; any other error as
    it is."""
    try:
        yield
    except RunFilesError:
        raise
    except Exception as exc:
        failed = os_error(exc)
        if failed is None:
            raise
        raise RunFilesError(f"cannot write {path}: {errors.first_line(failed)}") from exc


_owners: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
"""The writer threads whose failed writes are logged in one line, and whose they are."""
_previous_hook: Callable[[threading.ExceptHookArgs], object] | None = None
"""The thread exception hook that was there when this module's went in (once)."""


def _log_writer_failure(args: threading.ExceptHookArgs) -> None:
    owner = _owners.get(args.thread) if args.thread is not None else None
    if owner is not None and (failed := os_error(args.exc_value)) is not None:
        log.error("%s could not write: %s", owner, failed)
    elif _previous_hook is not None:
        _previous_hook(args)


def quiet_writer_threads(threads: set[threading.Thread], owner: str) -> None:
    """A failed write in one of ``threads`` (TensorBoard's writer, which raises it again on its
    owner's next write) is logged in one line naming ``owner``, not printed as a traceback."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook, threading.excepthook = threading.excepthook, _log_writer_failure
    for thread in threads:
        _owners[thread] = owner
