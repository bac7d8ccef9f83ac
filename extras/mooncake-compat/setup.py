"""Puts ``mooncake_core_fallback.pth`` at the top of the wheel (it lands in site-packages,
where Python's ``site`` runs it at start-up), for wheels and editable installs alike."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "mooncake_core_fallback.pth"


class WithPth(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        out = self.get_finalized_command("install").install_lib if editable else self.build_lib
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PTH, Path(out) / PTH.name)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = (
            [] if getattr(self, "editable_mode", False) else [str(Path(self.build_lib) / PTH.name)]
        )
        return [*super().get_outputs(include_bytecode), *extra]


setup(cmdclass={"build_py": WithPth})
