"""Files in the suite's own folders: written never through a link, read bounded.

:func:`write_file` opens every folder below the owned root with ``O_NOFOLLOW``,
refuses a link where the file goes (:class:`LinkInTheWay`) and writes whole to a
temporary name renamed into place, so no existing inode (a hard link included) is
written into. :func:`read_json` reads a regular file only (no FIFO or device
blocks it), bounded in bytes and depth. Standard library only; see docs/safety.md.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 << 20  # a summary.json of a run of 10,000 tests is ~20 MB
MAX_JSON_DEPTH = 64  # summary.json nests ~8 deep; Python's parser recurses per level
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkInTheWay(OSError):
    """A symbolic link (or another non-file) sits where the suite writes."""

    def __init__(self, path: Path, what: str = "a symbolic link") -> None:
        """Name the path and what is there."""
        super().__init__(errno.ELOOP, f"{path} is {what}; the suite writes only "
                         "its own files, never through a link: remove it")
        self.path = path

    def __str__(self) -> str:
        """The message alone (no ``[Errno 40]``)."""
        return str(self.strerror)


def _open_dir(root: Path, parts: tuple[str, ...]) -> int:
    """A descriptor of ``root/parts...``, made as needed, no part a link."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LinkInTheWay(root, "not a real folder") from None
        raise
    here = root
    for part in parts:
        here = here / part
        try:
            os.mkdir(part, 0o777, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LinkInTheWay(here, "a symbolic link or a file, not a folder"
                                   ) from None
            raise
        os.close(fd)
        fd = sub
    return fd


def write_file(path: str | os.PathLike[str], data: bytes | str,
               root: str | os.PathLike[str] | None = None) -> Path:
    """Write ``path`` whole, never through a link; return ``path``.

    ``root`` is the folder the suite owns (default the file's folder; its own path may
    contain links, it may not be one); folders below it are made as needed. Text is
    written as UTF-8.

    Raises:
        LinkInTheWay: the file, or a folder on the way below ``root``, is a link.
        OSError: the folder cannot be written.

    """
    path = Path(path)
    base = Path(root) if root is not None else path.parent
    rel = path.relative_to(base).parts
    payload = data.encode() if isinstance(data, str) else data
    dfd = _open_dir(base, rel[:-1])
    name, tmp = rel[-1], f".{rel[-1]}.{os.getpid()}.tmp"
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise LinkInTheWay(path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                               else "not a regular file")
        try:
            os.unlink(tmp, dir_fd=dfd)  # a leftover of a killed run (or a link)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)
    return path


def read_bounded(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_BYTES
                 ) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, without blocking.

    Raises:
        OSError: not a regular file (a FIFO, a device, a folder), larger than
            ``max_bytes``, or unreadable; the message says which.

    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a "
                          "folder is never read)")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes >> 20} MiB")
    return data


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (a scalar is 0), iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (
                node.values() if isinstance(node, dict) else node))
    return deepest


def read_json(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON file the suite wrote, bounded (:func:`read_bounded`).

    Raises:
        OSError: as :func:`read_bounded`.
        ValueError: not UTF-8 JSON, or nested deeper than ``max_depth``.

    """
    text = read_bounded(path, max_bytes).decode("utf-8")
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    if json_depth(data) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return data


def save_figure(fig: Any, path: str | os.PathLike[str],
                root: str | os.PathLike[str] | None = None) -> Path:
    """Save a matplotlib figure as PNG (110 dpi) with :func:`write_file`."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return write_file(path, buf.getvalue(), root)
