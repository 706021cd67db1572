"""ortmodule's cache folder (`cache_home()`: $ORTMODULE_CACHE, else ~/.cache/ortmodule): what
is in it, and clearing it (`ortmodule cache list|clear`, docs/usage.md "The cache folder").

Every entry is remade on demand, so clearing costs only the time to remake what is used again:
- `graphs`: the rewritten graphs (the LM head at the positions asked for, the extend and prefill
  graphs), tens to hundreds of KB each; they reference the package's own weights;
- `costs`: the measured costs that decide context sharing (kept_costs.py), and which of ONNX Runtime's
  paths a 4-bit package's prefills take on this CPU (nbits.py), a few KB each;
- `packed`: ONNX Runtime's packed weights, about twice a package's weights each, written only with
  ORTMODULE_MAP_PACKED_WEIGHTS=1 (mapped.py).
Keys hold the package's content, the settings and ortmodule's code, so entries of packages since
changed or deleted, and of older ortmodule versions, are never read again. An entry's last use is
its modification time, renewed whenever a load reads it (`touch`), so `--older-than` removes what no
load has used for that long. A file or folder whose name starts with "." is a write in progress:
left alone for an hour, then counted as the remains of a process that was killed. The exception, files
named `.timing-DEVICE.lock` in `costs`: `exclusive`'s locks (a few bytes, never listed as entries), so
that processes that load packages at once time one device's runs one after the other, each time once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Windows: there `exclusive` holds off this process's other threads only
    fcntl = None

KINDS = {
    "graphs": "rewritten graphs (remade at the next load: a second or so each)",
    "costs": "measured costs and 4-bit path choices (remade where sharing or the path is decided: seconds to a "
             "minute on a CPU)",
    "packed": "packed weights (ORTMODULE_MAP_PACKED_WEIGHTS=1 only; remade at the next load)",
}
IN_PROGRESS = 3600  # seconds: a write younger than this is left alone


def cache_home() -> Path:
    """ortmodule's cache folder: $ORTMODULE_CACHE, else $XDG_CACHE_HOME/ortmodule, else ~/.cache/ortmodule."""
    return Path(os.environ.get("ORTMODULE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ortmodule"
    ))


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch


def touch(path: Path) -> None:
    """Renew an entry's last use (its modification time); a cache that cannot be written is no error."""
    with contextlib.suppress(OSError):
        os.utime(path)


def entries(kinds=tuple(KINDS), home: Path | None = None) -> list[Entry]:
    """The entries of `kinds` in the cache folder, oldest use first (writes in progress left out)."""
    home = Path(home) if home is not None else cache_home()
    now, found = time.time(), []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"no cache kind {kind!r}: the kinds are {', '.join(KINDS)}")
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for path in (home / kind).iterdir():
                if path.name.endswith(".lock"):  # `exclusive`'s locks
                    continue
                entry = _entry(kind, path)
                if entry is not None and not (path.name.startswith(".") and now - entry.last_used < IN_PROGRESS):
                    found.append(entry)
    return sorted(found, key=lambda e: e.last_used)


def _entry(kind: str, path: Path) -> Entry | None:
    """One entry: a file, or a folder (packed weights; its last use is that of its `complete` mark)."""
    try:
        stat = path.lstat()
        if not path.is_dir() or path.is_symlink():
            return Entry(kind, path, stat.st_size, stat.st_mtime)
        mark = path / "complete"
        last = mark.stat().st_mtime if mark.is_file() else stat.st_mtime
        return Entry(kind, path, folder_bytes(path), last)
    except OSError:  # removed meanwhile (another process clearing, or replacing it)
        return None


def write_atomically(entry: Path, text: str) -> OSError | None:
    """Write `text` to `entry` through a temporary file of this writer renamed into place, so that a
    reader sees the old content or the new, whole; the error where the folder cannot be written."""
    partial = entry.with_name(f".{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text)
        partial.replace(entry)
    except OSError as e:
        with contextlib.suppress(OSError):  # nothing to remove where the folder could not be made
            partial.unlink(missing_ok=True)
        return e
    return None


def timing_lock(folder: Path, device: str) -> Path:
    """The lock (`exclusive`) that runs timed on `device` ("cpu", "cuda0") take, in `folder`."""
    return Path(folder) / f".timing-{device}.lock"


_THREAD_LOCKS: dict[Path, threading.RLock] = {}
_HELD: dict[Path, int | None] = {}  # the locks this process holds: their open files (None: not made)
_MADE = threading.Lock()


def _forked() -> None:
    """In a child forked while a thread held a lock: the child has neither that thread nor its turn.
    Its copies of the lock files are closed (open, they would hold the parent's locks while the child
    lives), and its locks start anew."""
    for fd in filter(None, _HELD.values()):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _THREAD_LOCKS.clear()
    global _MADE
    _MADE = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def exclusive(lock: Path, then: str = ""):
    """Hold `lock` against every other thread of this process and every other process that asks for
    it (an exclusive `flock` on the file `lock`, made where missing): what is measured and kept once
    for all (kept_costs.py, nbits.py) is measured by one of them while the others wait, then read by
    them, and a timing is never taken while another process times the same device. Re-entrant
    within a thread. Where another process holds it, a line on stderr names that process and what
    follows the wait (`then`). Yields when the wait for another process began (`time.time()`), or
    None. Where the lock cannot be made (a folder that cannot be written, a file system without
    `flock`, Windows), this process's threads only."""
    # One lock per file, however its path is spelled: a second flock of the same file in one process
    # (another open file) would wait for the first.
    lock = Path(lock).resolve()
    with _MADE:
        thread_lock = _THREAD_LOCKS.setdefault(lock, threading.RLock())
    with thread_lock:
        outermost = lock not in _HELD
        waited_since = None
        if outermost:
            _HELD[lock], waited_since = _lock_file(lock, then)
        try:
            yield waited_since
        finally:
            held = _HELD.pop(lock, None) if outermost else None  # (None in a fork's child: closed there)
            if held is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(held, 0)  # no holder's pid left behind for the next waiter to name
                os.close(held)  # closing the file lets the lock go


def _lock_file(lock: Path, then: str) -> tuple[int | None, float | None]:
    """The open file of `lock`, locked (`exclusive`), None where it cannot be; and when the wait for
    another process began, or None."""
    if fcntl is None:
        return None, None
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None, None
    waited_since = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited_since = time.time()
            holder = _holder(fd)
            device = lock.stem.removeprefix(".timing-")
            print(f"ortmodule: waiting for process {holder}, which is timing runs on {device}, to finish"
                  f"{f' (then {then})' if then else ''}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:  # no flock on this file system
        os.close(fd)
        return None, None
    except BaseException:  # interrupted while waiting
        os.close(fd)
        raise
    return fd, waited_since


def _holder(fd: int, patience: float = 1.0) -> str:
    """The pid that the lock's holder wrote into it, or "unknown": a holder writes its pid just after
    its `flock` returns, so an empty file is read again for up to `patience` seconds (read at once,
    a process that came a moment after another named it "unknown": tests/test_kept_costs.py)."""
    deadline = time.monotonic() + patience
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text or time.monotonic() >= deadline:
            return text or "unknown"
        time.sleep(0.01)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (links not followed; files removed meanwhile skipped)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def other_folders(home: Path | None = None) -> list[tuple[str, int]]:
    """What else the cache folder holds (the demo's package, the test fixtures): names and bytes."""
    home = Path(home) if home is not None else cache_home()
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return [(p.name, folder_bytes(p) if p.is_dir() else p.lstat().st_size)
                for p in sorted(home.iterdir()) if p.name not in KINDS]
    return []


def remove(chosen: list[Entry]) -> list[tuple[Entry, OSError]]:
    """Remove the entries; those that could not be removed, with why (an entry already gone is not a
    failure). A process that has an entry loaded keeps using it: on Linux and macOS its files live
    on until it lets them go."""
    failed = []
    for entry in chosen:
        try:
            if entry.path.is_dir() and not entry.path.is_symlink():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:
            failed.append((entry, e))
    return failed


def size_text(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    for unit in ("KB", "MB", "GB"):
        count /= 1024
        if count < 1024 or unit == "GB":
            return f"{count:.1f} {unit}"
