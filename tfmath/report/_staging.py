"""Where a report is built before it is moved into place, and what crashed runs left behind.

A run builds its report in a hidden sibling folder, ``.<out>.<random>``, and
holds an exclusive lock on ``.<out>.<random>.lock`` for as long as it lives.
The operating system releases the lock when the process ends, however it
ends (SIGKILL included), so a folder whose lock can be taken belongs to a
run that is gone, and the next run removes it; a folder whose lock is held is
being written and is left alone. A finished run retires the report it replaces
to ``.<out>.old.<random>`` and deletes it. Only folders named as tfmath names
them are ever removed: a staging folder beside its lock file (a killed run
leaves both; a copy of a report beside it has no lock file) that is empty or
carries the report marker, and a retired one, whatever is left of it (its
deletion may have been interrupted after the marker went), so nothing of the
user's is touched.
"""

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; abandoned folders are then left in place
    fcntl = None

LOCK_SUFFIX = ".lock"


@contextlib.contextmanager
def staging_folder(out_dir, marker, marker_text):
    """A new folder beside ``out_dir``, holding ``marker``, locked while the caller builds in it.

    The folder is removed if the ``with`` block raises; on success the caller
    has moved it into place. The lock file is created (and locked) before the
    folder, so no live staging folder is ever without a held lock.
    """
    handle, lock_path = tempfile.mkstemp(
        prefix=f".{out_dir.name}.", suffix=LOCK_SUFFIX, dir=out_dir.parent
    )
    lock_path = Path(lock_path)
    with os.fdopen(handle, "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        staging = lock_path.with_name(lock_path.name.removesuffix(LOCK_SUFFIX))
        staging.mkdir(mode=0o755)
        try:
            (staging / marker).write_text(marker_text)
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            lock_path.unlink(missing_ok=True)


def remove_abandoned(out_dir, marker):
    """Remove the staging folders of ``out_dir`` that no live run holds.

    Returns
    -------
    list of pathlib.Path
        The folders removed.
    """
    if fcntl is None or not out_dir.parent.is_dir():
        return []
    # tempfile's names: eight of its characters after the prefix.
    random = r"[a-z0-9_]{8}"
    staged = re.compile(rf"\.{re.escape(out_dir.name)}\.{random}")
    retired = re.compile(rf"\.{re.escape(out_dir.name)}\.old\.{random}")
    removed = []
    for candidate in sorted(out_dir.parent.glob(f".{out_dir.name}.*")):
        if not candidate.is_dir():
            continue
        lock_path = candidate.with_name(candidate.name + LOCK_SUFFIX)
        if retired.fullmatch(candidate.name):
            pass
        elif not (
            staged.fullmatch(candidate.name)
            and lock_path.exists()
            and _staged_report(candidate, marker)
            and not _held(lock_path)
        ):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        lock_path.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def _staged_report(folder, marker):
    """Empty (a run died before writing anything), or a staged report."""
    return not any(folder.iterdir()) or (folder / marker).exists()


def _held(lock_path):
    """Whether a live process holds ``lock_path`` (a missing lock file is not held)."""
    try:
        lock = open(lock_path)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        lock.close()
    return False
