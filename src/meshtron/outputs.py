"""Writing what a user asked for without losing what is already there.

A command that makes a directory of results (``import-hf``, ``export-hf``) writes it whole under a
hidden name beside the target and renames it into place only when everything is written: a failure
leaves nothing behind, and a reader never sees half a directory. The target must be new (or an empty
directory): a directory that holds anything is someone's, and is refused in one line instead of being
written into. A run that fails before it wrote anything removes the directories it created for its
outputs, and only those.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from meshtron.errors import ConfigError

__all__ = ["check_new_directory", "first_missing", "new_directory", "readable_by_all", "remove_if_empty"]


def _holds_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_new_directory(path: str | os.PathLike, flag: str, *, inside: Path | None = None,
                        what: str = "the output") -> Path:
    """``path`` as an absolute path, if it can be written as a new directory: it does not exist or is an
    empty directory, and does not lie inside ``inside`` (the input, which must stay as it is); one line
    naming ``flag`` otherwise."""
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag}: {os.fspath(path)} is a file; give a new directory for {what}")
    if inside is not None:
        source = inside.resolve()
        resolved = target.resolve()
        if resolved == source or source in resolved.parents:
            raise ConfigError(f"{flag}: {os.fspath(path)} is inside the input {inside}, which is never written "
                              f"into; give a new directory outside it for {what}")
    if _holds_files(target):
        raise ConfigError(f"{flag}: {os.fspath(path)} already holds files ({_first_entry(target)}, ...); give a new "
                          f"or empty directory for {what} (nothing is overwritten)")
    return target


def _first_entry(path: Path) -> str:
    return min(p.name for p in path.iterdir())


@contextlib.contextmanager
def new_directory(path: str | os.PathLike, flag: str, *, inside: Path | None = None,
                  what: str = "the output") -> Iterator[Path]:
    """Write a new directory ``path`` whole: yields a hidden directory beside it to write into, renamed
    to ``path`` when the block ends without error, removed when it raises. ``path`` must be new or an
    empty directory (:func:`check_new_directory`)."""
    target = check_new_directory(path, flag, inside=inside, what=what)
    created = first_missing(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        yield partial
        if _holds_files(target):  # someone wrote there meanwhile: theirs stays, ours is dropped
            raise ConfigError(f"{flag}: {os.fspath(path)} was written by something else while this ran; nothing "
                              "of it was changed; give a new directory")
        os.replace(partial, target)  # onto a missing or empty directory: atomic
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if created is not None:
            remove_if_empty(target.parent, created)
        raise


def first_missing(path: str | os.PathLike) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what creating it would create
    first), or ``None`` when it exists."""
    path = Path(path).absolute()
    if path.exists():
        return None
    missing = path
    for parent in path.parents:
        if parent.exists():
            return missing
        missing = parent
    return missing


def remove_if_empty(path: str | os.PathLike, up_to: str | os.PathLike) -> None:
    """Remove the empty directory ``path`` and its empty parents, up to and including ``up_to`` (the
    first of them this process created); anything holding a file stays."""
    path, up_to = Path(path).absolute(), Path(up_to).absolute()
    if path != up_to and up_to not in path.parents:
        return
    for directory in (path, *path.parents):
        try:
            directory.rmdir()
        except OSError:  # not empty, or gone: stop there
            return
        if directory == up_to:
            return


def readable_by_all(path: str | os.PathLike) -> None:
    """Give a written file the permissions a new file gets under the process's umask (libraries that
    write through a private temporary file leave it ``0600``)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH) & ~mask)
