"""Every file a command writes goes through here, so a full disk ends the same way everywhere.

- ``write_file``: a whole file (checkpoint, config, summary, report, cache) is written to a
  temporary file beside its target, fsynced and renamed over it: a reader sees the old file or
  the new one, never a part.
- ``append_line``: a log line (``metrics.jsonl``, ``clients.jsonl``) is appended whole or the
  file is cut back to where it was.

A write the operating system refuses (no space, quota, a read-only or vanished folder) leaves
the previous file as it was, removes what it had started, and raises ``OutputError``: one line
naming the file, the folder's file system, how much the write needed and what is free.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional, Union

from fl_lightning.errors import RunError

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Errors that mean the device (or the quota, or the file-size limit) has no room."""


class OutputError(RunError):
    """A file could not be written; the previous version (if any) is intact. Exit status 1."""


def write_file(path: Union[str, Path], data: Union[bytes, bytearray, memoryview, str], kept: Optional[str] = None,
               then: str = "run the same command again") -> None:
    """Replace ``path`` by ``data`` atomically (UTF-8 for text); ``kept`` says what the failure
    leaves (default: whether a previous file exists), ``then`` what the user does next."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else memoryview(data).cast("B")
    if kept is None:
        kept = "the previous file is kept" if path.exists() else "nothing was written"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as error:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise OutputError(problem(error, path, len(payload), kept, then)) from None
        raise


def append_line(path: Union[str, Path], line: str, then: str = "run the same command again") -> None:
    """Append ``line`` and a newline to ``path`` whole, or leave the file as it was."""
    path = Path(path)
    payload = (line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    except OSError as error:
        raise OutputError(problem(error, path, len(payload), "the file is as it was", then)) from None
    try:
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, payload)
        except OSError as error:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise OutputError(problem(error, path, len(payload), "the file is as it was", then)) from None
    finally:
        os.close(fd)


def _write_all(fd: int, payload: memoryview) -> None:
    """``os.write`` until every byte is written (a write may take fewer bytes than offered)."""
    done = 0
    while done < len(payload):
        done += os.write(fd, payload[done:])


def problem(error: OSError, path: Path, needed: Optional[int], kept: str, then: str) -> str:
    """The one-line reason a write of ``needed`` bytes (None: unknown) to ``path`` failed."""
    folder = path.parent
    if error.errno in FULL:
        try:
            usage = shutil.disk_usage(_existing(folder))
            room = f"{megabytes(usage.free)} free of {megabytes(usage.total)}"
        except OSError:
            room = "free space unknown"
        what = "file-size limit reached" if error.errno == errno.EFBIG else "no space left on the device"
        needs = f", which needs {megabytes(needed)}" if needed is not None else ""
        return f"{what} in {folder} ({room}) while writing {path.name}{needs}; {kept}. Free some space and {then}"
    return f"cannot write {path} ({error.strerror or error}); {kept}. Fix {folder} and {then}"


def _existing(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{max(nbytes, 1) / 2**10:.1f} KiB"
