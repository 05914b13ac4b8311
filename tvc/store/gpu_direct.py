"""GPU-direct stores the suite can drive: the protocol, two adapters and the hook.

:class:`GpuDirectStore` is what the ``real_nvme`` and ``bandwidth`` tiers need. A
factory ``open(path, pool_bytes, **options)`` opens (creating when absent) a pool of
``pool_bytes`` bytes at ``path``; an existing pool keeps its contents, so a second
process opening the same spec sees the same bytes. Adapters: :func:`open_kvikio_store`
(kvikio ``CuFile`` on ``<path>/pool.bin``; GDS where nvidia-fs and cuFile allow it, else
``compat``) and :func:`open_posix_store` (host I/O, ``O_DIRECT`` where allowed; takes
CPU tensors, so self-tests run without a GPU). A profile's ``[store] factory =
"module:function"`` plugs in a target's store (docs/profiles.md, ``[store]``). Run as
``python -m tvc.store.gpu_direct '<json>'`` it is :func:`run_store_worker`'s worker.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pkgutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tvc.config.profile import REPO_ROOT
from tvc.core import run_store

ALIGN = 4096  # bytes: O_DIRECT and GDS alignment (GPU page size, per kvikio's docs)
POSIX_CHUNK = 16 << 20  # bytes per O_DIRECT bounce buffer in the POSIX adapter
POOL_FILE = "pool.bin"
IO_PATHS = ("gds", "compat", "posix")


class StoreError(Exception):
    """A store refused an operation or could not be opened (readable message)."""


@runtime_checkable
class GpuDirectStore(Protocol):
    """A GPU-direct store the suite can drive (see the module docstring).

    Attributes:
        capacity: usable bytes, ``[0, capacity)``.
        io_path: the path actually used: ``"gds"`` (GPUDirect Storage), ``"compat"``
            (cuFile/kvikio compat mode, host bounce buffers) or ``"posix"`` (host I/O).
        direct_io: True when data bypasses the page cache.

    """

    capacity: int
    io_path: str
    direct_io: bool

    def write(self, offset: int, src: Any) -> None:
        """Write all bytes of ``src`` (1-D contiguous uint8 tensor) at byte ``offset``.

        Raises:
            Exception: the range leaves ``[0, capacity)``; the pool is unchanged.

        """

    def read(self, offset: int, dst: Any) -> None:
        """Fill ``dst`` (1-D contiguous uint8 tensor) from the pool at ``offset``.

        Raises:
            Exception: the range leaves ``[0, capacity)``.

        """

    def sync(self) -> None:
        """Make every completed write durable."""

    def files(self) -> list[Path]:
        """Return every file or device the store writes."""

    def describe(self) -> dict[str, Any]:
        """Return facts for the report (adapter, io_path, versions, paths...)."""

    def close(self) -> None:
        """Release handles; the pool stays."""

    def destroy(self) -> None:
        """Close and remove the pool (everything ``files()`` named)."""


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _check_range(offset: int, nbytes: int, capacity: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > capacity:
        raise StoreError(
            f"range [{offset}, {offset + nbytes}) ({nbytes} bytes at offset {offset}) "
            f"is outside the pool [0, {capacity})")


def _nbytes(t: Any) -> int:
    """Bytes in a 1-D contiguous uint8 tensor or array (TypeError otherwise)."""
    dtype = str(getattr(t, "dtype", ""))
    if dtype not in ("torch.uint8", "uint8") or getattr(t, "ndim", 1) != 1:
        raise TypeError(f"expected a 1-D uint8 tensor, got {dtype} "
                        f"with {getattr(t, 'ndim', '?')} dims")
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        raise TypeError("expected a contiguous tensor")
    return int(t.numel()) if hasattr(t, "numel") else int(t.size)


def create_pool(file: Path, pool_bytes: int) -> None:
    """Create (or grow) ``file`` to ``pool_bytes`` rounded up to ALIGN, allocated.

    A new pool (and a missing folder) gets an ownership marker
    (:func:`tvc.core.run_store.mark_file_owned`); an unmarked existing file is refused
    (pre-marker pools inside ``<repo>/.scratch`` are adopted).

    Raises:
        StoreError: ``file`` exists and the suite did not make it.

    """
    if not file.parent.exists():
        with contextlib.suppress(FileExistsError):
            run_store.make_owned_dir(file.parent)
    if file.exists() and not run_store.file_owned(file) and not file.resolve(
            ).is_relative_to(REPO_ROOT / ".scratch"):
        raise StoreError(f"{file} exists and was not created by the suite (no "
                         f"{run_store.file_marker(file).name}); move it away or "
                         "choose another [store] path")
    run_store.mark_file_owned(file)
    want = _round_up(pool_bytes)
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < want:
            try:
                os.posix_fallocate(fd, 0, want)  # real blocks: GB-scale pool
            except OSError:
                os.ftruncate(fd, want)  # file systems without fallocate
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- POSIX


class PosixStore:
    """Reference store on host I/O: ``path/pool.bin``, ``O_DIRECT`` where possible.

    Device tensors are staged through host memory (``io_path`` is always ``"posix"``).
    Unaligned edges are read-modify-written under a lock, so writers of disjoint ranges
    never clobber each other. ``direct`` falls back to buffered I/O where refused.
    """

    adapter = "posix"

    def __init__(self, path: Path, pool_bytes: int, direct: bool = True) -> None:
        self.dir = Path(path)
        self.file = self.dir / POOL_FILE
        self.capacity = int(pool_bytes)
        self.io_path = "posix"
        create_pool(self.file, self.capacity)
        self._fd = os.open(self.file, os.O_RDWR)
        self._dfd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            self._dfd = self._open_direct()
        self.direct_io = self._dfd is not None
        self._rmw = threading.Lock()

    def _open_direct(self) -> int | None:
        try:
            dfd = os.open(self.file, os.O_RDWR | os.O_DIRECT)
        except OSError:
            return None
        buf = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(dfd, [buf], 0)  # some file systems accept the flag, not the I/O
        except OSError:
            os.close(dfd)
            return None
        finally:
            buf.close()
        return dfd

    # host views -------------------------------------------------------------
    @staticmethod
    def _host(src: Any) -> tuple[memoryview, Any]:
        """Return (bytes view of src on the host, keep-alive object)."""
        if hasattr(src, "device") and str(src.device) != "cpu":
            src = src.cpu()
        arr = src.numpy() if hasattr(src, "numpy") else src
        return memoryview(arr).cast("B"), arr

    def write(self, offset: int, src: Any) -> None:  # noqa: D102 - see protocol
        n = _nbytes(src)
        _check_range(offset, n, self.capacity)
        view, _keep = self._host(src)
        self._write_bytes(offset, view)

    def read(self, offset: int, dst: Any) -> None:  # noqa: D102 - see protocol
        n = _nbytes(dst)
        _check_range(offset, n, self.capacity)
        on_device = hasattr(dst, "device") and str(dst.device) != "cpu"
        if on_device:
            import torch

            host = torch.empty(n, dtype=torch.uint8)
            self._read_bytes(offset, memoryview(host.numpy()).cast("B"))
            dst.copy_(host)
        else:
            view, _keep = self._host(dst)
            self._read_bytes(offset, view)

    def _write_bytes(self, offset: int, view: memoryview) -> None:
        if self._dfd is None:
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
            return
        for pos in range(0, len(view), POSIX_CHUNK):
            part = view[pos:pos + POSIX_CHUNK]
            self._direct_io(offset + pos, part, write=True)

    def _read_bytes(self, offset: int, view: memoryview) -> None:
        if self._dfd is None:
            done = 0
            while done < len(view):
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got == 0:
                    raise StoreError(f"short read at offset {offset + done}")
                done += got
            return
        for pos in range(0, len(view), POSIX_CHUNK):
            self._direct_io(offset + pos, view[pos:pos + POSIX_CHUNK], write=False)

    def _direct_io(self, off: int, part: memoryview, write: bool) -> None:
        """One O_DIRECT transfer through an aligned bounce buffer."""
        a0, a1 = off // ALIGN * ALIGN, _round_up(off + len(part))
        buf = mmap.mmap(-1, a1 - a0)  # page-aligned
        try:
            head = off - a0
            if not write:
                self._full(os.preadv, buf, a0)
                part[:] = buf[head:head + len(part)]
                return
            if off == a0 and off + len(part) == a1:
                buf[:] = part
                self._full(os.pwritev, buf, a0)
                return
            with self._rmw:  # edges share blocks with neighbours: read-modify-write
                self._full(os.preadv, buf, a0)
                buf[head:head + len(part)] = part
                self._full(os.pwritev, buf, a0)
        finally:
            buf.close()

    def _full(self, fn: Callable[..., int], buf: mmap.mmap, off: int) -> None:
        mv, done = memoryview(buf), 0
        try:
            while done < len(mv):
                got = fn(self._dfd, [mv[done:]], off + done)
                if got <= 0:
                    raise StoreError(f"short O_DIRECT transfer at offset {off + done}")
                done += got
        finally:
            mv.release()

    def sync(self) -> None:  # noqa: D102 - see protocol
        os.fsync(self._fd)

    def files(self) -> list[Path]:  # noqa: D102 - see protocol
        return [self.file]

    def describe(self) -> dict[str, Any]:  # noqa: D102 - see protocol
        return {"adapter": self.adapter, "io_path": self.io_path,
                "direct_io": self.direct_io, "pool_file": str(self.file),
                "capacity_bytes": self.capacity}

    def close(self) -> None:  # noqa: D102 - see protocol
        for fd in (self._fd, self._dfd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd, self._dfd = -1, None

    def destroy(self) -> None:  # noqa: D102 - see protocol
        self.close()
        _remove_pool(self.file)


def _remove_pool(file: Path) -> None:
    """Remove a pool the suite made (marker beside it), and its folder if ours."""
    run_store.remove_owned_file(file)
    run_store.remove_if_only_marker(file.parent)


def open_posix_store(path: Path, pool_bytes: int, direct: bool = True) -> PosixStore:
    """Open the host-I/O reference store (factory; see :class:`PosixStore`)."""
    return PosixStore(Path(path), pool_bytes, direct=direct)


# -------------------------------------------------------------------------- kvikio


def import_kvikio() -> Any:
    """Import and return kvikio, or explain how to get it.

    Raises:
        StoreError: kvikio (or libkvikio / libcufile behind it) does not load.

    """
    try:
        import kvikio
        import kvikio.cufile_driver  # noqa: F401
        import kvikio.defaults  # noqa: F401
    except Exception as exc:  # ImportError, DynamicLibNotFoundError, OSError
        raise StoreError(
            f"kvikio does not import ({type(exc).__name__}: {exc}). Install the "
            "kvikio-cu13, libkvikio-cu13, rapids-logger and cuda-pathfinder wheels, "
            "e.g. `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`, "
            "and put /tmp/site on PYTHONPATH. When libcufile.so.0 is not found, "
            "also install .whl/fallback/nvidia_cufile*.whl there and add "
            "/tmp/site/nvidia/cu13/lib to LD_LIBRARY_PATH (cuda-pathfinder searches "
            "site-packages, not PYTHONPATH).") from None
    return kvikio


def kvikio_io_path(kvikio: Any) -> tuple[str, dict[str, Any]]:
    """Which path kvikio's CuFile really takes here: (``"gds"``/``"compat"``, facts).

    ``gds`` needs kvikio not preferring compat mode, cuFile reporting GDS available, and
    the nvidia-fs kernel driver (without it cuFile runs in compat mode).
    """
    facts: dict[str, Any] = {"kvikio_version": getattr(kvikio, "__version__", "")}
    try:
        mode = kvikio.defaults.get("compat_mode")
        facts["compat_mode_setting"] = getattr(mode, "name", str(mode))
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        facts["compat_mode_setting"] = f"unknown ({exc})"
    try:
        facts["compat_mode_preferred"] = bool(
            kvikio.defaults.is_compat_mode_preferred())
    except Exception:  # noqa: BLE001
        facts["compat_mode_preferred"] = True
    try:
        facts["cufile_gds_available"] = bool(
            kvikio.cufile_driver.get("is_gds_available"))
    except Exception as exc:  # noqa: BLE001 - no libcufile: compat
        facts["cufile_gds_available"] = False
        facts["cufile_error"] = str(exc)[:200]
    facts["nvidia_fs_driver"] = (Path("/proc/driver/nvidia-fs").exists()
                                 or Path("/sys/module/nvidia_fs").exists())
    gds = (not facts["compat_mode_preferred"] and facts["cufile_gds_available"]
           and facts["nvidia_fs_driver"])
    if gds:
        facts["why"] = "cuFile with the nvidia-fs driver"
    elif facts["compat_mode_preferred"]:
        facts["why"] = "kvikio compat mode: POSIX I/O through host bounce buffers"
    else:
        facts["why"] = ("cuFile without a usable nvidia-fs driver: cuFile's compat "
                        "mode (host bounce buffers)")
    return ("gds" if gds else "compat"), facts


class KvikioStore:
    """Reference GPU-direct store: kvikio ``CuFile`` on ``<path>/pool.bin``.

    ``direct`` asks kvikio for ``O_DIRECT`` in compat mode (``auto_direct_io_read``/
    ``_write``, where supported); ``task_size`` is bytes (None = kvikio's default).

    Raises:
        StoreError: kvikio does not import.

    """

    adapter = "kvikio"

    def __init__(self, path: Path, pool_bytes: int, direct: bool = True,
                 task_size: int | None = None) -> None:
        kvikio = import_kvikio()
        self.dir = Path(path)
        self.file = self.dir / POOL_FILE
        self.capacity = int(pool_bytes)
        self.task_size = task_size
        create_pool(self.file, self.capacity)
        self._defaults = None
        if direct:
            try:
                self._defaults = kvikio.defaults.set(
                    {"auto_direct_io_read": True, "auto_direct_io_write": True})
            except (KeyError, ValueError, AttributeError):
                self._defaults = None  # an older kvikio without these settings
        self._f = kvikio.CuFile(str(self.file), "r+")
        self.io_path, self._facts = kvikio_io_path(kvikio)
        try:
            self.direct_io = bool(self._f.is_direct_io_supported()) or (
                self.io_path == "gds")
        except AttributeError:
            self.direct_io = self.io_path == "gds"

    @staticmethod
    def _buf(t: Any) -> Any:
        if hasattr(t, "device") and str(t.device) == "cpu" and hasattr(t, "numpy"):
            return t.numpy()
        return t

    def write(self, offset: int, src: Any) -> None:  # noqa: D102 - see protocol
        n = _nbytes(src)
        _check_range(offset, n, self.capacity)
        got = self._f.pwrite(self._buf(src), n, offset, self.task_size).get()
        if got != n:
            raise StoreError(f"kvikio wrote {got} of {n} bytes at offset {offset}")

    def read(self, offset: int, dst: Any) -> None:  # noqa: D102 - see protocol
        n = _nbytes(dst)
        _check_range(offset, n, self.capacity)
        got = self._f.pread(self._buf(dst), n, offset, self.task_size).get()
        if got != n:
            raise StoreError(f"kvikio read {got} of {n} bytes at offset {offset}")

    def sync(self) -> None:  # noqa: D102 - see protocol
        os.fsync(self._f.fileno())

    def files(self) -> list[Path]:  # noqa: D102 - see protocol
        return [self.file]

    def describe(self) -> dict[str, Any]:  # noqa: D102 - see protocol
        return {"adapter": self.adapter, "io_path": self.io_path,
                "direct_io": self.direct_io, "pool_file": str(self.file),
                "capacity_bytes": self.capacity, **self._facts}

    def close(self) -> None:  # noqa: D102 - see protocol
        if not self._f.closed:
            self._f.close()
        if self._defaults is not None:
            self._defaults.__exit__(None, None, None)
            self._defaults = None

    def destroy(self) -> None:  # noqa: D102 - see protocol
        self.close()
        _remove_pool(self.file)


def open_kvikio_store(path: Path, pool_bytes: int, direct: bool = True,
                      task_size: int | None = None) -> KvikioStore:
    """Open the kvikio reference store (factory; see :class:`KvikioStore`)."""
    return KvikioStore(Path(path), pool_bytes, direct=direct, task_size=task_size)


# ---------------------------------------------------------------- spec and opening


@dataclass(frozen=True)
class StoreSpec:
    """How to open the profile's store; the fields of its ``[store]`` section.

    Attributes:
        factory: ``module:function`` returning a :class:`GpuDirectStore`.
        path: pool location ("" = the profile names no store).
        pool_bytes: capacity to open, bytes.
        test_devices: paths outside scratch the store may write.

    """

    factory: str
    path: str
    pool_bytes: int
    options: Mapping[str, Any] = field(default_factory=dict)
    scratch: str = ""
    test_devices: Sequence[str] = ()

    @classmethod
    def from_profile(cls, profile: Any) -> StoreSpec:
        """Build the spec from a :class:`tvc.config.profile.Profile`."""
        s = profile["store"]
        return cls(factory=s["factory"], path=s["path"],
                   pool_bytes=int(s["pool_bytes"]), options=dict(s["options"]),
                   scratch=str(profile.scratch),
                   test_devices=tuple(s["test_devices"]))

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict (for the worker process)."""
        return {"factory": self.factory, "path": self.path,
                "pool_bytes": self.pool_bytes, "options": dict(self.options),
                "scratch": self.scratch, "test_devices": list(self.test_devices)}

    def with_path(self, path: str | Path, pool_bytes: int | None = None
                  ) -> StoreSpec:
        """The same store at another path (and optionally another size)."""
        return StoreSpec(self.factory, str(path), pool_bytes or self.pool_bytes,
                         self.options, self.scratch, self.test_devices)


def allowed_roots(spec: StoreSpec) -> list[Path]:
    """Directories the store may write under: scratch and the profile's devices."""
    return [Path(p).resolve() for p in (spec.scratch, *spec.test_devices) if p]


def outside_allowed(paths: Sequence[Path | str], spec: StoreSpec) -> list[str]:
    """Return the paths that lie outside scratch and the profile's test devices."""
    roots = allowed_roots(spec)
    out = []
    for p in paths:
        rp = Path(p).resolve()
        if not any(rp == r or r in rp.parents for r in roots):
            out.append(str(p))
    return out


def load_factory(name: str) -> Callable[..., GpuDirectStore]:
    """Resolve ``module:function``.

    Raises:
        StoreError: malformed name, module does not import, or no such function.

    """
    mod, _, fn = name.partition(":")
    if not mod or not fn:
        raise StoreError(f"[store] factory {name!r} is not 'module:function'")
    try:
        return pkgutil.resolve_name(name)
    except AttributeError as exc:
        if mod in sys.modules:  # the module imported: the function is missing
            raise StoreError(f"[store] factory {name!r}: {mod} has no {fn}") from None
        err: Exception = exc
    except ValueError:  # pkgutil's "invalid format" (e.g. a dotted name not valid)
        raise StoreError(f"[store] factory {name!r} is not 'module:function'"
                         ) from None
    except Exception as exc:  # noqa: BLE001 - anything the module raised on import
        err = exc
    raise StoreError(
        f"[store] factory {name!r}: module {mod} does not import "
        f"({type(err).__name__}: {err}); put it on PYTHONPATH") from None


def open_store(spec: StoreSpec) -> GpuDirectStore:
    """Open the store a spec names, refusing paths outside the allowed area.

    Raises:
        StoreError: no store configured, path outside scratch/test devices, factory
            problems, or the returned object misses part of the protocol.

    """
    if not spec.path:
        raise StoreError("the profile names no store ([store] path is empty)")
    bad = outside_allowed([spec.path], spec)
    if bad:
        raise StoreError(
            f"the store path {spec.path} lies outside the suite's scratch directory "
            f"{spec.scratch} and is not listed in [store] test_devices: the suite "
            "writes nowhere else. Move [store] path under ${SCRATCH} or list the "
            "test device in [store] test_devices.")
    factory = load_factory(spec.factory)
    try:
        store = factory(Path(spec.path), spec.pool_bytes, **dict(spec.options))
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(
            f"[store] factory {spec.factory}(path={spec.path!r}, "
            f"pool_bytes={spec.pool_bytes}, **{dict(spec.options)!r}) failed: "
            f"{type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("capacity", "io_path", "direct_io", "write", "read",
                           "sync", "files", "describe", "close", "destroy")
               if not hasattr(store, m)]
    if missing:
        raise StoreError(f"[store] factory {spec.factory} returned "
                         f"{type(store).__name__}, which lacks {', '.join(missing)} "
                         "(see the GpuDirectStore protocol in tvc/store/gpu_direct.py)")
    if store.io_path not in IO_PATHS:
        raise StoreError(f"store reports io_path {store.io_path!r}; expected one of "
                         f"{', '.join(IO_PATHS)}")
    return store


# ------------------------------------------------------------------ worker process


def run_store_worker(spec: StoreSpec, op: str, offset: int, nbytes: int, seed: int,
                     device: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run one write or verify-read in a fresh Python process on the same pool.

    ``op`` is ``"write"`` (the :func:`tvc.store.checks.pattern` of ``seed``) or
    ``"verify"``; ``offset``/``nbytes`` in bytes; ``device`` ``"cuda"`` or ``"cpu"``;
    ``timeout_s`` before the worker is killed. Returns its JSON: ``ok``, ``pid``, and
    for ``verify`` ``mismatches`` and ``first_mismatch`` (pool offset, expected, seen).

    Raises:
        StoreError: the worker failed or timed out (with its stderr tail).

    """
    req = {"spec": spec.to_json(), "op": op, "offset": offset, "nbytes": nbytes,
           "seed": seed, "device": device}
    try:
        out = subprocess.run(  # noqa: S603 - our own module, argv list
            [sys.executable, "-m", "tvc.store.gpu_direct", json.dumps(req)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
            check=False)
    except subprocess.TimeoutExpired:
        raise StoreError(f"store worker ({op}) did not finish in {timeout_s:g} s"
                         ) from None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise StoreError(f"store worker ({op}) exited {out.returncode}: "
                         f"{out.stderr.strip()[-1500:]}")
    return json.loads(lines[-1])


def _worker_main(arg: str) -> int:
    import torch

    from tvc.store.checks import first_mismatch, pattern

    req = json.loads(arg)
    s = req["spec"]
    spec = StoreSpec(s["factory"], s["path"], s["pool_bytes"], s["options"],
                     s["scratch"], tuple(s["test_devices"]))
    store = open_store(spec)
    try:
        off, n, seed, dev = req["offset"], req["nbytes"], req["seed"], req["device"]
        ans: dict[str, Any] = {"ok": True, "pid": os.getpid(),
                               "io_path": store.io_path}
        if req["op"] == "write":
            store.write(off, pattern(off, n, seed, dev))
            store.sync()
        else:
            got = torch.empty(n, dtype=torch.uint8, device=dev)
            store.read(off, got)
            ans.update(first_mismatch(got, pattern(off, n, seed, dev), off))
        print(json.dumps(ans), flush=True)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
