"""Building the compiled CPU kernels: at install (the prebuilt library), or just in time, never waiting without bound.

Imported by the package (``backends/common/cpu/__init__.py``) and by ``setup.py`` (by path, before the package is
installed), so it imports nothing but the standard library and torch.

**What a build is** (:class:`BuildSpec`): the sources, the compile and link flags (at::vec's flags for the vector
instruction set torch reports) and the torch it is built against. Its :meth:`~BuildSpec.key` is a SHA-256 over all
of them — every source's name and bytes, every flag, torch's version and git revision, Python's ABI tag — so two
builds with the same key are interchangeable and two with different keys never share a file:

- **prebuilt** (:func:`prebuilt_library`): ``setup.py`` compiles the library into the package (``_kernels*.so``)
  and writes the key beside it (``_kernels.json``). A process loads it only when the key matches its own: same
  sources, flags and torch; otherwise (sources edited since, another torch, a wheel built on a machine with
  another instruction set) the library is never loaded (a library built against another torch may crash at load).
- **just in time** (:func:`jit_build`): ``torch.utils.cpp_extension.load`` into ``<torch extensions dir>/
  <prefix>_<isa>_<key[:16]>``, content-addressed: the sources are staged into the build directory and compiled from
  there, so two checkouts with the same sources share one build (their paths differ, but the compile commands do
  not) and two with different sources build side by side, neither ever rebuilding the other's.

**The lock** (:class:`BuildLock`): ``flock`` on ``<build dir>/brcompile.lock``, which holds the holder's PID, host
and start time. The kernel drops the lock when its holder dies however it dies (SIGKILL, the OOM killer, a
scheduler's limit), so a dead holder never blocks anyone. What a killed build leaves behind — torch's own lock file
(``<build dir>/lock``, on which ``cpp_extension.load`` would poll forever) and half-written objects — is removed by
the next holder, which reads from the lock's record that the previous build never finished, and says so in the log.
A *live* holder (another process building right now, or one hung) is waited for at most ``timeout`` seconds
(``BRCOMPILE_CPU_KERNELS_WAIT``, default 300), with a log line naming the holder and the lock; past that the build
counts as failed (:class:`BuildTimeout`).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["BuildError", "BuildLock", "BuildSpec", "BuildTimeout", "jit_build", "kernel_spec", "prebuilt_library",
           "wait_bound", "write_prebuilt_record"]

HERE = Path(__file__).resolve().parent

#: the kernels' sources, in this directory
KERNEL_SOURCES = ("tree_attention.cpp", "prefix_tree.cpp")

#: the prebuilt library's module name inside the package (``brcompile.backends.common.cpu._kernels``) and its record
PREBUILT_NAME = "_kernels"
PREBUILT_RECORD = f"{PREBUILT_NAME}.json"

#: at::vec's flags per vector instruction set (ATen/cpu/vec), by ``torch.backends.cpu.get_cpu_capability()``.
ISA_FLAGS = {
    "AVX512": ("-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"),
    "AVX2": ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"),
}
BASE_CFLAGS = ("-O3", "-std=c++17", "-fopenmp")
BASE_LDFLAGS = ("-fopenmp",)

#: seconds a process waits on another's build lock before counting the build as failed (env overrides)
DEFAULT_WAIT_S = 300.0
#: after this many seconds of waiting, the wait is logged as a warning (before: info)
_WARN_AFTER_S = 5.0
_POLL_S = 0.1


class BuildError(RuntimeError):
    """A build of the compiled CPU kernels did not produce a loadable library."""


class BuildTimeout(BuildError):
    """Another live process held the build lock for longer than the bound."""


def wait_bound() -> float:
    """``BRCOMPILE_CPU_KERNELS_WAIT``: the seconds to wait on another process's build (default 300)."""
    value = os.environ.get("BRCOMPILE_CPU_KERNELS_WAIT", "").strip()
    try:
        return float(value) if value else DEFAULT_WAIT_S
    except ValueError:
        log.warning("brcompile: BRCOMPILE_CPU_KERNELS_WAIT=%r is not a number of seconds; waiting %g s", value,
                    DEFAULT_WAIT_S)
        return DEFAULT_WAIT_S


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """One build: ``prefix`` (the module name's stem), the sources and the flags, against the running torch."""

    prefix: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    def key(self) -> str:
        """SHA-256 over each source's name and bytes, the flags, torch's version and revision and Python's ABI:
        two builds with one key are interchangeable, two with different keys share nothing."""
        h = hashlib.sha256()
        for part in (self.prefix, torch.__version__, getattr(torch.version, "git_version", ""),
                     sys.implementation.cache_tag, getattr(sys, "abiflags", ""), *self.cflags, "|", *self.ldflags):
            h.update(part.encode() + b"\0")
        for source in self.sources:
            h.update(source.name.encode() + b"\0")
            h.update(source.read_bytes())
        return h.hexdigest()

    def name(self, key: Optional[str] = None) -> str:
        """The just-in-time module name: ``<prefix>_<key[:16]>``, private to this exact build."""
        return f"{self.prefix}_{(key or self.key())[:16]}"


def kernel_spec(isa: Optional[str] = None) -> BuildSpec:
    """The compiled CPU kernels' build for ``isa`` (default: the instruction set torch reports on this CPU)."""
    isa = isa or torch.backends.cpu.get_cpu_capability()
    return BuildSpec(prefix=f"brcompile_cpu_{isa.lower()}", sources=tuple(HERE / s for s in KERNEL_SOURCES),
                     cflags=(*BASE_CFLAGS, *ISA_FLAGS.get(isa, ())), ldflags=BASE_LDFLAGS)


# ---------------------------------------------------------------------------------------------------------- prebuilt

def write_prebuilt_record(library: Path, spec: BuildSpec) -> Path:
    """Beside the library ``setup.py`` built, the record a process checks before loading it (its key)."""
    record = library.with_name(PREBUILT_RECORD)
    record.write_text(json.dumps({"key": spec.key(), "library": library.name, "prefix": spec.prefix,
                                  "torch": torch.__version__}, indent=1) + "\n")
    return record


def prebuilt_library(spec: BuildSpec, directory: Path = HERE) -> tuple[Optional[Path], str]:
    """The prebuilt library in ``directory`` if its record's key is ``spec``'s, else None; and why (for the log)."""
    record = directory / PREBUILT_RECORD
    if not record.is_file():
        return None, f"no prebuilt library ({record} is missing: the package was installed without building it)"
    try:
        facts = json.loads(record.read_text())
        library = directory / facts["library"]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"the prebuilt library's record {record} is unreadable ({e})"
    if not library.is_file():
        return None, f"the prebuilt library {library} is missing"
    if facts.get("key") != spec.key():
        return None, (f"the prebuilt library {library.name} was built for other sources, flags or torch "
                      f"(torch {facts.get('torch')}, {facts.get('prefix')}; this process: torch "
                      f"{torch.__version__}, {spec.prefix})")
    return library, "the prebuilt library matches"


# -------------------------------------------------------------------------------------------------------------- lock

def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class BuildLock:
    """An exclusive ``flock`` on ``path`` for one build, bounded in how long it waits; the file records its holder.

    The record is JSON: ``{"pid", "host", "since", "state"}``, ``state`` "building" while held and "done" once
    released; a holder that finds "building" left by another process knows that build was killed
    (:attr:`interrupted` holds that record).
    """

    def __init__(self, path: Path, timeout: float, what: str = "build"):
        self.path, self.timeout, self.what = Path(path), timeout, what
        self.interrupted: Optional[dict] = None
        self._fd: Optional[int] = None

    def holder(self) -> dict:
        """The lock's record as the holder wrote it ({} when there is none or it is being written)."""
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def describe(self, record: dict) -> str:
        """The holder in words: PID, host, how long ago it took the lock, and whether it is still alive here."""
        if not record:
            return "an unknown process"
        alive = ""
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            alive = "" if _process_alive(record["pid"]) else ", no longer running"
        since = record.get("since")
        ago = f", {time.time() - since:.0f} s ago" if isinstance(since, (int, float)) else ""
        return f"PID {record.get('pid')} on {record.get('host')}{ago}{alive}"

    def acquire(self) -> "BuildLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        start, warned = time.monotonic(), False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                waited = time.monotonic() - start
                if waited >= self.timeout:
                    raise BuildTimeout(
                        f"waited {waited:.0f} s for the {self.what} held by {self.describe(self.holder())} "
                        f"(lock {self.path}); BRCOMPILE_CPU_KERNELS_WAIT sets the bound, and removing the lock file "
                        f"lets a new build start")
                if not warned and waited >= _WARN_AFTER_S:
                    warned = True
                    log.warning("brcompile: waiting for the %s held by %s (lock %s; giving up after %g s)",
                                self.what, self.describe(self.holder()), self.path, self.timeout)
                time.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        previous = self.holder()
        if previous.get("state") == "building" and previous.get("pid") != os.getpid():
            self.interrupted = previous
        self._write({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "state": "building"})
        return self

    def release(self) -> None:
        import fcntl

        if self._fd is None:
            return
        try:
            self._write({**self.holder(), "state": "done"})
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _write(self, record: dict) -> None:
        data = json.dumps(record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def __enter__(self) -> "BuildLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------------------------ just in time

def _clear_interrupted(build_dir: Path, lock: BuildLock) -> None:
    """What a killed build left in ``build_dir``: torch's lock file (cpp_extension.load polls on it forever) and
    half-written outputs; only the staged sources and our lock stay."""
    if lock.interrupted is None and not (build_dir / "lock").exists():
        return
    leftovers = [p for p in build_dir.iterdir() if p.name not in (lock.path.name, "src")]
    who = lock.describe(lock.interrupted or {})
    log.warning("brcompile: an earlier build of the compiled CPU kernels in %s (%s) did not finish; removing what "
                "it left (%s) and building again", build_dir, who,
                ", ".join(sorted(p.name for p in leftovers)) or "nothing")
    for p in leftovers:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def _stage_sources(spec: BuildSpec, build_dir: Path) -> list[str]:
    """The sources copied into ``build_dir/src`` (unchanged files untouched): every build of one key compiles the
    same paths, so ninja never sees another checkout's paths as a change."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    staged = []
    for source in spec.sources:
        target = src / source.name
        data = source.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        staged.append(str(target))
    return staged


def jit_build(spec: BuildSpec, timeout: Optional[float] = None, verbose: bool = False) -> dict:
    """Build (or find built) and load ``spec``'s library just in time, under :class:`BuildLock`.

    Returns ``{"library", "build_dir", "compiled"}`` (whether this call compiled anything). Raises
    :class:`BuildTimeout` past the wait bound and :class:`BuildError` when the build fails.
    """
    from torch.utils import cpp_extension

    key = spec.key()
    name = spec.name(key)
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build_dir / f"{name}.so"
    with BuildLock(build_dir / "brcompile.lock", wait_bound() if timeout is None else timeout,
                   what=f"build of {name}") as lock:
        _clear_interrupted(build_dir, lock)
        before = library.stat().st_mtime_ns if library.is_file() else None
        if before is None:
            log.warning("brcompile: compiling the CPU kernels (%s) into %s: once per source version and torch",
                        name, build_dir)
        sources = _stage_sources(spec, build_dir)
        try:
            cpp_extension.load(name=name, sources=sources, extra_cflags=list(spec.cflags),
                               extra_ldflags=list(spec.ldflags), build_directory=str(build_dir),
                               is_python_module=False, verbose=verbose)
        except Exception as e:
            raise BuildError(f"building {name} in {build_dir} failed: {e}") from e
    after = library.stat().st_mtime_ns if library.is_file() else None
    return {"library": str(library), "build_dir": str(build_dir), "compiled": after != before}
