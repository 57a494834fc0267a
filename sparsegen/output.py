"""Writing results all at once: a checkpoint or result folder appears complete, or not at all.

Everything is written into a temporary sibling (same file system) and renamed into place at the end, so a full disk,
a kill or an exception never leaves a half-written folder that later loads as something else; replacing an
existing folder swaps it whole, so no stale file of an earlier run survives.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_output(out: str | Path, source: str | Path | None = None, overwrite: bool = False,
                 folder: bool = True) -> Path:
    """Refuse, before any work: writing over the input model, a file where a folder goes (or the reverse), or an
    existing non-empty output unless ``overwrite``."""
    out = Path(out)
    if source is not None and Path(source).exists() and out.resolve() == Path(source).resolve():
        raise ValueError(f"--out {out} is the input model's own folder; write the output somewhere else")
    if folder and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if not folder and out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name")
    if out.exists() and (not folder or any(out.iterdir())) and not overwrite:
        raise ValueError(f"--out {out} exists{'' if not folder else ' and is not empty'}; pick a new "
                         f"{'folder' if folder else 'file'} or pass --force to replace it")
    return out


@contextmanager
def new_folder(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; when the block ends without error it becomes ``out``
    (replacing an existing one whole if ``overwrite``), otherwise it is deleted and ``out`` is untouched."""
    out = check_output(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield work
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(work, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def new_file(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; when the block ends without error the file there becomes ``out``."""
    out = check_output(out, overwrite=overwrite, folder=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(handle)
    work = Path(name)
    try:
        yield work
        os.replace(work, out)
    finally:
        work.unlink(missing_ok=True)
