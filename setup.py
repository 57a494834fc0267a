"""The project is declared in pyproject.toml; this file only adds lm-eval's start-up hook to every install.

Python runs ``.pth`` files at the top of site-packages at start-up. setuptools has no option for shipping one, so
``build_py`` writes it (and the module it imports, a copy of ``sparsegen/eval/lm_eval_hook.py``) there: into the
build folder for a wheel, into the wheel's root for an editable install (``pip install -e``).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = Path(__file__).parent / "sparsegen" / "eval" / "lm_eval_hook.py"
MODULE = "_sparsegen_lm_eval_hook"


class BuildWithLmEvalHook(build_py):
    def run(self) -> None:
        super().run()
        top = Path(self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib)
        top.mkdir(parents=True, exist_ok=True)
        (top / f"{MODULE}.py").write_text(HOOK.read_text())
        (top / "sparsegen-lm-eval.pth").write_text(f"import {MODULE}; {MODULE}.install()\n")


setup(cmdclass={"build_py": BuildWithLmEvalHook})
