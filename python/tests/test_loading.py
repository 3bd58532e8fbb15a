"""Loading the library, and the ctypes declarations against the committed C header: struct
fields in order with their types, every function's parameters, and every numeric constant."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import mori_tp
from mori_tp import _errors, _ffi

HEADER = Path(mori_tp.__file__).resolve().parents[2] / "include" / "mori_tp.h"

SCALARS = {
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int32_t": ctypes.c_int32,
    "size_t": ctypes.c_size_t,
    "MoriStatus": ctypes.c_int32,
    "MoriTpPool": ctypes.c_uint64,
}
# Every struct _ffi declares (each has its header size there); the header must hold the same set.
STRUCTS = {cls.__name__: cls for cls in _ffi.EXPECTED_SIZES}


def split_declaration(declaration: str):
    """'const struct MoriSegment *out' -> ('MoriSegment', 1, 'out'): base type, pointer depth,
    name."""
    words = declaration.replace("*", " * ").split()
    name = words[-1]
    depth = words.count("*")
    base = [w for w in words[:-1] if w not in ("const", "struct", "*")]
    return base[0], depth, name


def without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


@unittest.skipUnless(HEADER.is_file(), "the C header is not beside this package")
class HeaderParityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.header = without_comments(HEADER.read_text())

    def assertMatchesC(self, ctype, base: str, depth: int, where: str):
        if depth == 0:
            self.assertIs(ctype, SCALARS[base], where)
        elif ctype is ctypes.c_void_p:
            pass  # addresses: numpy and array.array buffers are passed by address
        elif ctype is ctypes.c_char_p:
            self.assertEqual((base, depth), ("char", 1), where)
        else:
            self.assertTrue(issubclass(ctype, ctypes._Pointer), where)
            self.assertMatchesC(ctype._type_, base, depth - 1, where)

    def test_structs_have_the_header_fields_in_order_with_their_types(self):
        found = re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", self.header, flags=re.S)
        self.assertEqual(sorted(name for name, _ in found), sorted(STRUCTS))
        for name, body in found:
            fields = [split_declaration(d) for d in body.split(";") if d.strip()]
            ours = STRUCTS[name]._fields_
            self.assertEqual([f[2] for f in fields], [f[0] for f in ours], name)
            for (base, depth, field), (_, ctype) in zip(fields, ours):
                if base in STRUCTS and depth == 0:
                    # A struct held by value (MoriTpPairConfig's two layouts).
                    self.assertIs(ctype, STRUCTS[base], f"{name}.{field}")
                    continue
                if base in STRUCTS or base == "void":
                    base = "uint8_t"  # opaque pointee: only the pointer depth matters
                    self.assertTrue(depth > 0, f"{name}.{field}")
                    self.assertTrue(ctype is ctypes.c_void_p
                                    or issubclass(ctype, ctypes._Pointer), f"{name}.{field}")
                    continue
                self.assertMatchesC(ctype, base, depth, f"{name}.{field}")
            self.assertEqual(ctypes.sizeof(STRUCTS[name]), _ffi.EXPECTED_SIZES[STRUCTS[name]])

    def test_every_function_is_declared_with_the_header_signature(self):
        found = re.findall(r"^([\w ]+?\*?)\s*(mori_\w+)\(([^)]*)\);", self.header, flags=re.M)
        self.assertEqual(sorted(f[1] for f in found), sorted(_ffi.SIGNATURES))
        for returns, name, params in found:
            restype, argtypes = _ffi.SIGNATURES[name]
            function = getattr(mori_tp._lib, name)
            self.assertIs(function.restype, restype, name)
            self.assertEqual(function.argtypes, argtypes, name)
            base, depth, _ = split_declaration(returns + " result")
            self.assertMatchesC(restype, base, depth, f"{name} return")
            declared = [] if params.strip() == "void" else params.split(",")
            self.assertEqual(len(declared), len(argtypes), name)
            for declaration, ctype in zip(declared, argtypes):
                base, depth, param = split_declaration(declaration)
                where = f"{name}({param})"
                if base in STRUCTS:
                    self.assertEqual(depth, 1, where)
                    if ctype is not ctypes.c_void_p:  # out arrays are passed by address
                        self.assertIs(ctype._type_, STRUCTS[base], where)
                else:
                    self.assertMatchesC(ctype, base, depth, where)

    def test_every_constant_has_the_header_value(self):
        defines = dict(
            (name, int(value))
            for name, value in re.findall(r"#define (MORI_\w+) (\d+)", self.header)
        )
        self.assertEqual(defines["MORI_TP_ABI_VERSION"], mori_tp.ABI_VERSION)
        self.assertEqual(defines["MORI_SEND_SYNCHRONIZE"], _ffi.MORI_SEND_SYNCHRONIZE)
        self.assertEqual(defines["MORI_SEND_COPY_KERNEL"], _ffi.MORI_SEND_COPY_KERNEL)
        self.assertEqual(defines["MORI_SEND_MEMCPY2D"], _ffi.MORI_SEND_MEMCPY2D)
        self.assertEqual(defines["MORI_OK"], _ffi.MORI_OK)
        errors = {cls.status: code for code, cls in _errors.ERROR_CLASSES.items()}
        self.assertEqual(errors, {k: v for k, v in defines.items() if k.startswith("MORI_ERR_")})
        actions = {f"MORI_TP_ACTION_{a.name}": a.value for a in mori_tp.Action}
        self.assertEqual(
            actions, {k: v for k, v in defines.items() if k.startswith("MORI_TP_ACTION_")})
        backends = {f"MORI_BACKEND_{k.upper()}": v for k, v in mori_tp._BACKENDS.items()}
        self.assertEqual(
            backends, {k: v for k, v in defines.items() if k.startswith("MORI_BACKEND_")})
        pool = {name: getattr(_ffi, name) for name in defines if name.startswith("MORI_TP_POOL_")}
        self.assertEqual(pool, {k: v for k, v in defines.items() if k.startswith("MORI_TP_POOL_")})
        self.assertEqual(len(pool), 4)


def import_in_subprocess(env_library):
    """Imports mori_tp in a fresh interpreter with MORI_TP_LIBRARY set as given (None: unset);
    returns (exit code, output)."""
    env = dict(os.environ)
    env.pop(_ffi.LIBRARY_ENV, None)
    if env_library is not None:
        env[_ffi.LIBRARY_ENV] = env_library
    env["PYTHONPATH"] = str(Path(mori_tp.__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-c", "import mori_tp; print(mori_tp.library_path)"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    return result.returncode, result.stdout + result.stderr


class LoadingTest(unittest.TestCase):
    def test_the_loaded_library_is_the_requested_one_and_speaks_our_abi(self):
        requested = os.environ.get(_ffi.LIBRARY_ENV)
        if requested:
            self.assertEqual(mori_tp.library_path, requested)
        else:
            first = next(p for p in _ffi.candidate_paths() if p.is_file())
            self.assertEqual(mori_tp.library_path, str(first))
        self.assertEqual(mori_tp._lib.mori_tp_abi_version(), mori_tp.ABI_VERSION)
        self.assertRegex(mori_tp.library_version(), r"^\d+\.\d+\.\d+")
        self.assertEqual(mori_tp.__version__, mori_tp.library_version())

    def test_a_missing_requested_library_fails_the_import_naming_it(self):
        missing = "/nonexistent/libmori_tp.so"
        code, output = import_in_subprocess(missing)
        self.assertNotEqual(code, 0)
        self.assertIn("ImportError", output)
        self.assertIn(f"MORI_TP_LIBRARY is set to {missing!r}, which is not a file", output)

    def test_a_file_that_is_not_a_library_fails_the_import(self):
        code, output = import_in_subprocess(str(Path(_ffi.__file__).resolve()))
        self.assertNotEqual(code, 0)
        self.assertIn("ImportError: mori_tp: cannot load", output)

    def test_without_the_variable_the_first_existing_candidate_is_loaded(self):
        existing = [p for p in _ffi.candidate_paths() if p.is_file()]
        code, output = import_in_subprocess(None)
        if not existing:
            self.assertNotEqual(code, 0)
            self.assertIn("cannot find", output)
            self.assertIn("target/debug", output)
        else:
            self.assertEqual(code, 0, output)
            self.assertEqual(output.strip(), str(existing[0]))

    def test_a_library_of_another_abi_version_or_platform_is_refused(self):
        self.assertIsNone(_ffi.check_layout(_ffi.ABI_VERSION, 8))
        self.assertEqual(
            _ffi.check_layout(2, 8),
            "the library has ABI version 2, but this mori_tp package was written for ABI "
            "version 1; use the package and library of the same build",
        )
        self.assertIn("64-bit platforms only (pointer size 4 bytes)", _ffi.check_layout(1, 4))


if __name__ == "__main__":
    unittest.main()
