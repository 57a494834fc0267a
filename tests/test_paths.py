"""sparsegen's cache folder, and inductor's compile cache inside it (set before torch._dynamo fixes it)."""

import os
import subprocess
import sys

from sparsegen.paths import cache_root, use_compile_cache


def test_the_compile_cache_is_in_sparsegens_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_root() == tmp_path and use_compile_cache() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")


def test_importing_sparsegen_sets_it_before_torch_fixes_its_own(tmp_path):
    """``torch._dynamo``'s import fixes inductor's folder for the process (``/tmp`` unless set): sparsegen's import
    must come first, whatever it imports."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"SPARSEGEN_CACHE": str(tmp_path)}
    script = ("import os, sparsegen, torch._dynamo, torch._inductor.runtime.cache_dir_utils as c; "
              "print(c.cache_dir())")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "inductor")
