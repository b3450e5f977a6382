"""The compiled CPU kernels, built when the package is installed (everything else is in pyproject.toml).

torch must be importable while building, so install with ``pip install --no-build-isolation`` into an environment
that has torch (README): the library is then built against that very torch, and ``backends/common/cpu/build.py`` writes
beside it the record a process checks before loading it. Without torch, or without a working C++ compiler, the
package installs without the library and builds it just in time on first use instead (or runs the torch paths).
"""
import importlib.util
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _build_module():
    """backends/common/cpu/build.py, loaded by path (the package is not importable before it is installed)."""
    spec = importlib.util.spec_from_file_location(
        "_brcompile_cpu_build", ROOT / "backends" / "common" / "cpu" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _skip(why: str) -> dict:
    print(f"brcompile: not building the compiled CPU kernels at install ({why}); they are built just in time on "
          f"first use instead", file=sys.stderr)
    return {}


def kernel_extension() -> dict:
    """setup() arguments that build backends/common/cpu's kernels as ``brcompile.backends.common.cpu._kernels``
    ({} if not here)."""
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return _skip("torch is not importable in the build environment: pip install --no-build-isolation")
    build = _build_module()
    spec = build.kernel_spec()

    class BuildKernels(BuildExtension):
        """BuildExtension that records what it built (build.write_prebuilt_record) and never fails the install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # no compiler, missing headers: the package still installs
                _skip(f"the build failed: {type(e).__name__}: {e}")
                return
            build.write_prebuilt_record(Path(self.get_ext_fullpath(ext.name)), spec)

        def copy_extensions_to_source(self):
            """An editable install copies the library into the source tree: its record goes beside it."""
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace, _ = self._get_inplace_equivalent(build_py, ext)
                if Path(inplace).is_file():
                    build.write_prebuilt_record(Path(inplace), spec)

    ext = CppExtension(f"brcompile.backends.common.cpu.{build.PREBUILT_NAME}",
                       sources=[str(s.relative_to(ROOT)) for s in spec.sources],
                       extra_compile_args=list(spec.cflags), extra_link_args=list(spec.ldflags))
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildKernels}}


setup(**kernel_extension())
