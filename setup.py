"""Build hooks for `pip install .`; the package's metadata is in pyproject.toml.

setuptools-rust builds libmori_tp with cargo (release profile) as a library without Python
bindings. Three things here cannot be said in TOML:

- the version is Cargo.toml's, so the wheel and the library it holds always agree;
- the library keeps its platform name (libmori_tp.so) inside the package, where mori_tp looks
  for it first, rather than a CPython extension-module name (libmori_tp.cpython-311-....so);
- the wheel is tagged py3-none-<platform>: the library does not use Python's C API, so one
  wheel serves every Python 3 on a platform.

MORI_TP_FEATURES selects cargo features (for example MORI_TP_FEATURES=hip for the HIP backend).
setuptools' own build files go to target/python-build, next to cargo's.
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension, build_rust

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def crate_version() -> str:
    with open(ROOT / "Cargo.toml", "rb") as manifest:
        return tomllib.load(manifest)["package"]["version"]


def library_file_name() -> str:
    """The platform's name for the shared library, as mori_tp._ffi.library_file_name says."""
    if sys.platform == "darwin":
        return "libmori_tp.dylib"
    if sys.platform == "win32":
        return "mori_tp.dll"
    return "libmori_tp.so"


class BuildLibraryInPackage(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        extension_path = Path(super().get_dylib_ext_path(ext, target_fname))
        return str(extension_path.with_name(library_file_name()))


class BdistWheelAnyPython(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


features = os.environ.get("MORI_TP_FEATURES", "").replace(",", " ").split()
build_base = ROOT / "target" / "python-build"
build_base.mkdir(parents=True, exist_ok=True)

setup(
    version=crate_version(),
    rust_extensions=[
        RustExtension(
            "mori_tp.libmori_tp",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            features=features,
            debug=False,
        )
    ],
    cmdclass={"build_rust": BuildLibraryInPackage, "bdist_wheel": BdistWheelAnyPython},
    options={"build": {"build_base": str(build_base)}, "egg_info": {"egg_base": str(build_base)}},
    zip_safe=False,
)
