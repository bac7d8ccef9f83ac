"""Installs ``mooncake_lmdeploy.pth`` next to the package in site-packages.

LMDeploy has no plugin entry points; this one-line ``.pth`` file (run by Python's
``site`` at every start-up) calls ``mooncake_lmdeploy.autoload.install()``, which adds
an import hook and nothing else. See ``src/mooncake_lmdeploy/autoload.py``. Works for
wheels (the file lands in purelib) and for editable installs (setuptools >= 64: the
file is written into the editable wheel).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mooncake_lmdeploy.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # editable_wheel points install_lib at the unpacked editable wheel
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        assert target is not None
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / "src" / PTH, Path(target) / PTH)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
