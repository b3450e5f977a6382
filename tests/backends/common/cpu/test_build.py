"""Where the compiled CPU kernels come from (backends/common/cpu/build.py): the prebuilt library loads with no
compiler and only when it matches; just-in-time builds are private to one source version; and no way of killing or
stalling a build leaves a later process waiting without bound.

The just-in-time tests build a one-op library (a few seconds) in a fresh extensions directory, each build in its own
process as a user's jobs would; the kernels' own library is only ever loaded from the prebuilt file here."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from brcompile.backends.common import cpu as kernels
from brcompile.backends.common.cpu import build

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH")

#: a one-op library: brcompile_buildtest::plus(x) = x + ADDEND
TINY = """\
#include <ATen/core/Tensor.h>
#include <torch/library.h>
static at::Tensor plus(const at::Tensor& x) {{ return x.add({addend}); }}
TORCH_LIBRARY_FRAGMENT(brcompile_buildtest, m) {{ m.def("plus(Tensor x) -> Tensor", &plus); }}
"""

#: builds the one-op library of the source tree argv[1] just in time and prints what it did and what plus(0) is
BUILD_SCRIPT = textwrap.dedent("""\
    import json, logging, sys
    from pathlib import Path
    import torch
    from brcompile.backends.common.cpu.build import BuildSpec, BuildTimeout, jit_build
    logging.basicConfig(level=logging.INFO)
    spec = BuildSpec("brcompile_buildtest", (Path(sys.argv[1]) / "ops.cpp",), cflags=("-O0",))
    try:
        done = jit_build(spec)
    except BuildTimeout as e:
        print(json.dumps({"timeout": str(e)}))
        sys.exit(0)
    done["plus"] = torch.ops.brcompile_buildtest.plus(torch.zeros(1)).item()
    print(json.dumps(done))
""")

#: holds the build lock argv[1] until killed
HOLD_SCRIPT = textwrap.dedent("""\
    import sys, time
    from brcompile.backends.common.cpu.build import BuildLock
    with BuildLock(sys.argv[1], timeout=5):
        print("held", flush=True)
        time.sleep(600)
""")


def _tree(root: Path, name: str, addend: int) -> Path:
    """A source tree holding the one-op library with ``addend``."""
    tree = root / name
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "ops.cpp").write_text(TINY.format(addend=addend))
    return tree


def _spec(tree: Path) -> build.BuildSpec:
    return build.BuildSpec("brcompile_buildtest", (tree / "ops.cpp",), cflags=("-O0",))


def _env(ext_dir: Path, **extra) -> dict:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), **extra}


def _build_in_process(tree: Path, ext_dir: Path, timeout: float = 300, **env) -> dict:
    """Run BUILD_SCRIPT for ``tree`` in a new process; its JSON line, plus its log as "log"."""
    done = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(tree)], env=_env(ext_dir, **env),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


def _hold(lock: Path, ext_dir: Path) -> subprocess.Popen:
    """A process holding ``lock``, alive until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(lock)], env=_env(ext_dir),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (a compiler mid-way), as a scheduler's limit would."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


# ----------------------------------------------------------------------------------------------------------- the key

def test_the_key_covers_sources_flags_and_torch(tmp_path, monkeypatch):
    """Any change to a source's bytes, a flag or torch's version gives another key, hence another module name and
    build directory; the same bytes at another path give the same key (the build is content-addressed)."""
    a, b = _spec(_tree(tmp_path, "a", 1)), _spec(_tree(tmp_path, "b", 1))
    assert a.key() == b.key() and a.name() == b.name() and a.key()[:16] in a.name()
    edited = _spec(_tree(tmp_path, "c", 2))
    assert edited.key() != a.key()
    assert build.BuildSpec(a.prefix, a.sources, cflags=("-O1",)).key() != a.key()
    assert build.BuildSpec(a.prefix, a.sources, a.cflags, ldflags=("-lm",)).key() != a.key()
    key = a.key()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert a.key() != key


def test_the_kernels_spec_names_the_instruction_set():
    """The kernels' build carries the instruction set's flags, so a library for AVX-512 never loads on AVX2."""
    avx2, avx512 = build.kernel_spec("AVX2"), build.kernel_spec("AVX512")
    assert "-mavx2" in avx2.cflags and "-mavx512f" in avx512.cflags and avx2.key() != avx512.key()
    assert [s.name for s in avx2.sources] == list(build.KERNEL_SOURCES)


# ------------------------------------------------------------------------------------------------------------ prebuilt

def test_a_prebuilt_library_is_used_only_when_its_record_matches(tmp_path):
    """setup.py's record beside the library: a matching key loads it; other sources (an edited checkout), a missing
    record or a missing library never do, each with its reason."""
    spec = _spec(_tree(tmp_path, "a", 1))
    library = tmp_path / "_kernels.cpython-test.so"
    library.write_bytes(b"not loaded by this test")
    assert build.prebuilt_library(spec, tmp_path)[0] is None
    assert "missing" in build.prebuilt_library(spec, tmp_path)[1]
    build.write_prebuilt_record(library, spec)
    assert build.prebuilt_library(spec, tmp_path) == (library, "the prebuilt library matches")
    edited = _spec(_tree(tmp_path, "b", 2))
    found, why = build.prebuilt_library(edited, tmp_path)
    assert found is None and "other sources, flags or torch" in why
    library.unlink()
    assert build.prebuilt_library(spec, tmp_path)[0] is None


def test_the_installed_package_loads_its_prebuilt_library_without_a_compiler(tmp_path):
    """README's install (pip install --no-build-isolation) builds the kernels into the package: a process with no
    compiler on PATH loads them at once and builds nothing."""
    found, why = build.prebuilt_library(build.kernel_spec(), Path(build.__file__).parent)
    assert found is not None, (f"{why}; README's install command builds the kernels at install "
                               f"(pip install --no-build-isolation -e .)")
    empty = tmp_path / "bin"
    empty.mkdir()
    script = textwrap.dedent("""\
        import shutil, time
        import torch
        from brcompile.backends.common import cpu
        from brcompile.runtime.tree import build_tree
        assert shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("cc") is None
        start = time.perf_counter()
        assert cpu.available() and cpu.library_source() == "prebuilt", cpu.unavailable_reason()
        tree = build_tree([torch.tensor([[1, 2, 3], [1, 2, 4]])])
        assert tree.num_tokens == 4, tree.num_tokens
        print(f"{time.perf_counter() - start:.3f}")
    """)
    ext_dir = tmp_path / "ext"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_env(ext_dir, PATH=str(empty), BRCOMPILE_CPU_KERNELS="prebuilt"))
    assert done.returncode == 0, done.stderr
    assert not ext_dir.exists() or not any(ext_dir.iterdir()), "nothing is built just in time"


def test_forcing_the_prebuilt_library_raises_where_there_is_none(monkeypatch):
    """BRCOMPILE_CPU_KERNELS=prebuilt never builds: without a matching library it raises, naming why."""
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.setattr(build, "prebuilt_library", lambda spec, directory=None: (None, "no prebuilt library here"))
    monkeypatch.setattr(build, "jit_build", lambda *a, **k: pytest.fail("prebuilt mode must not build"))
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "prebuilt")
    with pytest.raises(kernels.CpuKernelError, match="no prebuilt library here"):
        kernels.available()


# -------------------------------------------------------------------------------------------------------- just in time

@needs_compiler
@pytest.mark.slow
def test_two_source_trees_never_rebuild_each_other(tmp_path):
    """Checkouts with the same sources share one build (the second compiles nothing); a checkout with other sources
    builds beside it; going back to the first compiles nothing and loads its own library."""
    ext = tmp_path / "ext"
    a, same, edited = _tree(tmp_path, "a", 1), _tree(tmp_path, "same", 1), _tree(tmp_path, "edited", 2)
    first = _build_in_process(a, ext)
    assert first["compiled"] and first["plus"] == 1.0
    library = Path(first["library"])
    stamp = library.stat().st_mtime_ns
    shared = _build_in_process(same, ext)
    assert not shared["compiled"] and shared["library"] == first["library"] and shared["plus"] == 1.0
    other = _build_in_process(edited, ext)
    assert other["compiled"] and other["build_dir"] != first["build_dir"] and other["plus"] == 2.0
    again = _build_in_process(a, ext)
    assert not again["compiled"] and again["plus"] == 1.0
    assert library.stat().st_mtime_ns == stamp, "the first tree's library was never rebuilt"


@needs_compiler
@pytest.mark.slow
def test_a_build_killed_midway_does_not_block_the_next_process(tmp_path):
    """SIGKILL a process (and its compiler) while it builds, with torch's own lock file in place: the next process
    removes what the killed build left, says so, and builds."""
    ext, tree = tmp_path / "ext", _tree(tmp_path, "a", 3)
    build_dir = ext / _spec(tree).name()
    victim = subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(tree)], env=_env(ext),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (build_dir / "lock").exists():  # torch's FileBaton: cpp_extension.load is compiling
        assert victim.poll() is None, "the build finished before it could be killed"
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    _kill(victim)
    assert (build_dir / "lock").exists(), "the killed build left torch's lock behind (what used to hang)"
    start = time.monotonic()
    after = _build_in_process(tree, ext, timeout=240, BRCOMPILE_CPU_KERNELS_WAIT="60")
    assert after["compiled"] and after["plus"] == 3.0
    assert "did not finish" in after["log"] and f"PID {victim.pid}" in after["log"], after["log"]
    assert time.monotonic() - start < 200


def test_a_dead_holder_frees_the_lock_and_is_named(tmp_path):
    """The lock is the kernel's flock: a holder killed by SIGKILL releases it at once, and the next holder reads
    from the record that its build never finished."""
    lock = tmp_path / "brcompile.lock"
    holder = _hold(lock, tmp_path)
    _kill(holder)
    start = time.monotonic()
    with build.BuildLock(lock, timeout=10) as taken:
        assert time.monotonic() - start < 5
        assert taken.interrupted and taken.interrupted["pid"] == holder.pid
        assert "no longer running" in taken.describe(taken.interrupted)
        assert taken.holder()["pid"] == os.getpid() and taken.holder()["state"] == "building"
    assert build.BuildLock(lock, timeout=1).holder()["state"] == "done"
    with build.BuildLock(lock, timeout=1) as clean:
        assert clean.interrupted is None, "a finished build is not an interrupted one"


def test_a_live_holder_is_waited_for_at_most_the_bound(tmp_path, caplog, monkeypatch):
    """Another live process holding the lock (building, or hung): the wait ends at the bound with BuildTimeout
    naming the holder's PID and the lock's path, and the log said what it was waiting for."""
    lock = tmp_path / "brcompile.lock"
    holder = _hold(lock, tmp_path)
    monkeypatch.setattr(build, "_WARN_AFTER_S", 0.2)
    try:
        start = time.monotonic()
        with caplog.at_level("WARNING", logger=build.__name__):
            with pytest.raises(build.BuildTimeout) as raised:
                build.BuildLock(lock, timeout=1.5, what="build of x").acquire()
        assert 1.5 <= time.monotonic() - start < 10
        assert f"PID {holder.pid}" in str(raised.value) and str(lock) in str(raised.value)
        assert any("waiting for the build of x" in r.message and str(lock) in r.message for r in caplog.records)
    finally:
        _kill(holder)


def test_a_wait_past_the_bound_is_a_failed_build(tmp_path, monkeypatch, caplog):
    """While another process holds the kernels' build lock past BRCOMPILE_CPU_KERNELS_WAIT: "auto" warns once,
    naming the lock, and runs the torch paths; "jit" (and "1") raise."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS_WAIT", "1")
    monkeypatch.setattr(build, "prebuilt_library", lambda spec, directory=None: (None, "no prebuilt library here"))
    lock = tmp_path / build.kernel_spec().name() / "brcompile.lock"
    holder = _hold(lock, tmp_path)
    try:
        monkeypatch.setattr(kernels, "_STATE", {})
        monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "auto")
        with caplog.at_level("WARNING", logger=kernels.__name__):
            assert not kernels.available()
        assert "BuildTimeout" in kernels.unavailable_reason() and str(lock) in kernels.unavailable_reason()
        assert sum("could not be loaded or built" in r.message for r in caplog.records) == 1
        assert not kernels.available() and kernels.library_source() is None  # decided once per process
        for how in ("jit", "1"):
            monkeypatch.setattr(kernels, "_STATE", {})
            monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", how)
            with pytest.raises(kernels.CpuKernelError, match=f"PID {holder.pid}"):
                kernels.available()
    finally:
        _kill(holder)
