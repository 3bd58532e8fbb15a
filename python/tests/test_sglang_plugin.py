"""mori_tp.sglang without SGLang: it imports, and says what is missing when SGLang runs it.

Its behaviour inside SGLang is tested against SGLang 0.5.23's real code by sglang_mori.py (run
from tests/sglang.rs with the venv of .ci/sglang-venv)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import unittest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


class SglangPluginWithoutSglang(unittest.TestCase):
    def test_importing_the_plugin_does_not_import_sglang(self):
        # In a fresh interpreter, so that nothing else has imported it.
        code = ("import sys, mori_tp, mori_tp.sglang as p; "
                "print(sorted(p.TARGETS)); print('sglang' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=os.environ.copy())
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[-1], "False", out.stdout)
        self.assertIn("MoriKVManager._build_tp_slice_config", lines[0])
        self.assertIn("MoriKVManager._build_tp_slice_transfer_plan", lines[0])
        self.assertIn("staging_buffer.compute_head_slice_params", lines[0])

    @unittest.skipIf(HAVE_SGLANG, "SGLang is installed here: sglang_mori.py tests register()")
    def test_register_without_sglang_names_it(self):
        import mori_tp.sglang

        with self.assertRaises(ModuleNotFoundError) as caught:
            mori_tp.sglang.register()
        self.assertEqual(caught.exception.name, "sglang")

    def test_the_entry_point_is_declared(self):
        """SGLang finds plugins in the entry point group sglang.srt.plugins: the installed
        distribution's metadata, or pyproject.toml in a checkout."""
        declared = {ep.name: ep.value
                    for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
                    if ep.dist is not None and ep.dist.name == "mori-tp"}
        if not declared:
            pyproject = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
            if not os.path.isfile(pyproject) or sys.version_info < (3, 11):
                self.skipTest("no installed mori-tp and no pyproject.toml to read (or no "
                              "tomllib before Python 3.11)")
            import tomllib

            with open(pyproject, "rb") as f:
                declared = tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]
        self.assertEqual(declared, {"mori_tp": "mori_tp.sglang:register"})


if __name__ == "__main__":
    unittest.main()
