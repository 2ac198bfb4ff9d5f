"""One run per folder: ``<out_dir>/<name>/run.lock`` holds the PID of the ``fit`` that writes there.

The lock is an advisory ``flock`` on that file, so the operating system releases it when the
process ends in any way (kill -9 included): a lock file left by a killed run names a process
that no longer holds it, and the next ``fit --resume auto`` takes it over. A second ``fit``
while the first runs is refused at once, naming the folder and the first one's PID.

Folders created only to hold the lock are removed again when the command ends without
writing anything else into them, so a refused run leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import List, Optional

from fl_lightning.errors import ConfigError

LOCK = "run.lock"


def launching_process() -> bool:
    """False in the rank processes a launcher started for this run (they run under its lock):
    Fabric's and torchrun's ranks (``RANK``...) and SLURM's tasks (``SLURM_PROCID``) other than
    the first."""
    return all(os.environ.get(name, "0") == "0" for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))


class RunLock:
    """Context manager holding the run folder's lock; ``key`` names the option the folder came from."""

    def __init__(self, run_path: Path, key: str = "name"):
        self.run_path, self.key = Path(run_path), key
        self.path = self.run_path / LOCK
        self.created: List[Path] = []
        self.fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        folder = self.run_path
        while not folder.exists() and folder.parent != folder:
            self.created.append(folder)
            folder = folder.parent
        try:
            self.run_path.mkdir(parents=True, exist_ok=True)
            self._acquire()
        except OSError as error:
            self._remove_created()
            raise ConfigError(self.key, f"cannot create {self.path} ({error.strerror or error})") from None
        except BaseException:
            self._remove_created()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        self._remove_created()

    def _acquire(self) -> None:
        for _ in range(3):  # the file can be removed by its holder between our open and our flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ConfigError(self.key, f"{self.run_path} is in use by process {holder} (lock file {self.path}); "
                                            f"wait for that run to end, or choose another --{self.key}") from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)
        raise ConfigError(self.key, f"could not lock {self.run_path}: another process keeps replacing {self.path}")

    def _remove_created(self) -> None:
        """Remove, deepest first, the folders this lock created, while they are empty."""
        for folder in self.created:
            try:
                folder.rmdir()
            except FileNotFoundError:  # removed already (a failed fresh run removes its folder)
                continue
            except OSError:
                break
        self.created = []
