"""Atomic file writes: a reader sees the old file or the new one, never half of one.

The data goes to a uniquely named file beside the target (same filesystem, so the rename is
atomic), is flushed and fsynced, then ``os.replace``-d over the target, and the directory is
fsynced so that the rename itself is durable. Checkpoints, summaries and traces use it.
:func:`settle_writes` is for a process that must exit at once (a second Ctrl-C): writes in flight
are completed when their data is durable, else dropped, so no temporary file is left behind.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "settle_writes"]

# temporary file -> (its target, whether its data is durable), while a write is in flight
_in_flight: dict[Path, tuple[Path, bool]] = {}


def atomic_write_bytes(path: str | os.PathLike, data: bytes, keep_previous: str | os.PathLike | None = None,
                       on_durable: Callable[[], None] | None = None) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data), keep_previous, on_durable)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object],
                 keep_previous: str | os.PathLike | None = None, on_durable: Callable[[], None] | None = None) -> None:
    """Write to ``path`` what ``write`` writes to the binary file it is given (straight to the
    file: a 70 MB checkpoint saved through a bytes buffer took 0.12-0.27 s, 0.07 s this way), so
    that readers never see a partial file. With ``keep_previous``, the file ``path`` held moves
    there once the new data is durable. ``on_durable`` runs between the two (fault injection: a
    crash at the worst moment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name beside the target (same filesystem, so os.replace is atomic); opened
    # exclusively, with the usual permissions (umask), unlike tempfile's private 0600 files.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            _in_flight[tmp] = (path, False)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _in_flight[tmp] = (path, True)
        if keep_previous is not None and path.exists():
            os.replace(path, keep_previous)  # a crash here leaves the previous, which resume falls back to
        if on_durable is not None:
            on_durable()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _in_flight.pop(tmp, None)
    _fsync_dir(path.parent)


def settle_writes() -> list[Path]:
    """Finish what :func:`atomic_write_bytes` calls left in flight, for a process about to exit
    without unwinding (``os._exit`` from a signal handler): a durable write takes its place, a
    partial one is removed. Returns the targets written."""
    done = []
    for tmp, (path, durable) in list(_in_flight.items()):
        try:
            if durable:
                os.replace(tmp, path)
                done.append(path)
            else:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass
        _in_flight.pop(tmp, None)
    return done


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
