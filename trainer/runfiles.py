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
from collections.abc import Iterator
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


_quiet: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_hooked: list[object] = []


def quiet_writer_threads(threads: set[threading.Thread], owner: str) -> None:
    """A failed write in one of ``threads`` (TensorBoard's writer, which raises it again on its
    owner's next write) is logged in one line naming ``owner``, not printed as a traceback."""
    if not _hooked:
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            thread, exc = args.thread, args.exc_value
            if thread is not None and thread in _quiet and (failed := os_error(exc)) is not None:
                log.error("%s could not write: %s", getattr(thread, "edgerl_owner", owner), failed)
                return
            previous(args)

        threading.excepthook = hook
        _hooked.append(hook)
    for thread in threads:
        thread.edgerl_owner = owner  # type: ignore[attr-defined]
        _quiet.add(thread)
