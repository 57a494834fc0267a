"""sparsegen's C++ kernels, the shared layer under ``quant`` (the w8a8 and w4a8 linears) and ``kv`` (decode
attention): the ``sparsegen`` op library, and one ``cpp_extension`` build of every kernel source, once a process
(~30 s the first time, then cached by PyTorch in ``~/.cache/torch_extensions``). ``torch.compile`` keeps each op
whole in its graph, by its fake (shape) function. Each kernel takes AVX2 where the CPU has it (the w4a8, w5a8 and Q8_0
dot products AVX-512 VNNI, where it has that), a portable path otherwise (``SPARSEGEN_KERNELS=avx2`` or ``=scalar``
caps the path, as the tests do)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from sparsegen.paths import use_compile_cache

LIBRARY = torch.library.Library("sparsegen", "DEF")
SOURCES = ("quant/w8a8_linear.cpp", "quant/w4a8_linear.cpp", "kv/decode_attention.cpp")
HEADERS = ("avx2.h", "quant/w4a8_dots.h")  # (the AVX2 paths share one; the w4a8 kernel includes the other twice)


@contextlib.contextmanager
def sole_loader(build_directory: Path) -> Iterator[None]:
    """Around ``cpp_extension.load`` of ``build_directory``: an OS lock on a file beside it, which the system lets go
    of when its process ends, however it ends. PyTorch's own lock (a ``lock`` file in the folder, made by every load,
    cached or not) stays behind when its process is killed inside the load (Ctrl-C during the first build), and every
    later load then waits for it forever, silently. Every sparsegen process loads through here, so a ``lock`` file
    found while this lock is held is such a leftover: it is removed, and said."""
    try:
        import fcntl
    except ImportError:  # (not a POSIX system: PyTorch's lock alone)
        yield
        return
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(build_directory.parent / f"{build_directory.name}.sparsegen-lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        leftover = build_directory / "lock"
        if leftover.exists():
            print(f"sparsegen: removing {leftover}, left by a process that ended while loading the kernels",
                  file=sys.stderr, flush=True)
            leftover.unlink(missing_ok=True)
        yield


@functools.cache
def build() -> str | None:
    """Build and load every kernel: None, or why they could not be built (the callers fall back, and say so)."""
    from torch.utils import cpp_extension

    package = Path(__file__).parent
    try:
        if shutil.which("ninja") is None:  # (pip's ninja, when the venv's bin/ is not on PATH)
            import ninja
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        # (named by the torch it is built against: PyTorch's cache tells builds apart by source and flags only)
        name = "sparsegen_kernels_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        if not any(root.glob(f"**/{name}/{name}.so")):  # (else a silent half minute)
            print("sparsegen: building its C++ kernels, once (~30 s; cached in ~/.cache/torch_extensions)",
                  file=sys.stderr, flush=True)
        # (PyTorch rebuilds when a source or a flag changes, not a header: the headers' digest is a flag)
        header = hashlib.sha256(b"".join((package / name).read_bytes() for name in HEADERS)).hexdigest()[:16]
        folder = getattr(cpp_extension, "_get_build_directory", None)  # (PyTorch's folder for the build)
        with sole_loader(Path(folder(name, verbose=False))) if folder else contextlib.nullcontext():
            cpp_extension.load(name, [str(package / source) for source in SOURCES],
                               extra_cflags=["-O3", "-fopenmp", f"-DSPARSEGEN_HEADER={header}"],
                               extra_ldflags=["-fopenmp"], is_python_module=False)  # (ATen's parallel_for inlined)
        return None
    except Exception as error:  # (no compiler, no ninja, headers of another build: the ops still run, slower)
        lines = str(error).strip().splitlines() or [""]  # (a failed build's message: the commands, then the error)
        reason = next((line for line in lines if "error:" in line), lines[-1]).strip()
        return f"{type(error).__name__}: {reason}"


def remember_vector_isas() -> None:
    """Before a process's first compile: spare inductor its probe of the CPU's vector instruction sets where an
    earlier process on this machine found them all usable. Inductor checks each set the CPU lists (here: AVX-512
    with VNNI and AMX, AVX-512, AVX2) by building a test library and loading it in a child Python, once a process:
    ~1.2 s of every ``serve`` start, warm compile cache or not. The verdict is kept in the compile cache's folder,
    named by the CPU's flags, torch, Python and the C++ compiler. Where every listed set passed, ``cpp.vec_isa_ok``
    (inductor's own switch: the listed sets are usable) is set, in the probing process too, since the switch is
    part of inductor's cache key. Where one failed (AMX in a VM that grants no tile state), inductor probes every
    process, as it would; a user's ``TORCHINDUCTOR_VEC_ISA_OK`` is left as it is."""
    import json
    import platform

    from torch._inductor import config, cpu_vec_isa

    try:  # (inductor's own helpers: where this PyTorch has other ones, inductor probes as it would)
        from torch._inductor.cpp_builder import get_cpp_compiler

        probed, checker = cpu_vec_isa.valid_vec_isa_list, cpu_vec_isa.x86_isa_checker
        supported = cpu_vec_isa.supported_vec_isa_list
    except (ImportError, AttributeError):
        return
    if getattr(config.cpp, "vec_isa_ok", True) is not None or platform.machine() not in ("x86_64", "AMD64"):
        return
    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    stat = os.stat(compiler) if os.path.exists(compiler) else None
    flags = sorted(checker())
    machine = [torch.__version__, sys.executable, compiler, stat and (stat.st_size, stat.st_mtime_ns), flags,
               os.environ.get("ATEN_CPU_CAPABILITY")]
    key = hashlib.sha256(json.dumps(machine).encode()).hexdigest()[:24]
    record = Path(use_compile_cache()) / "vec-isa" / f"{key}.json"
    listed = [str(isa) for isa in supported if all(f in flags for f in str(isa).split())]
    try:
        usable = json.loads(record.read_text())["usable"]
    except (OSError, ValueError, KeyError, TypeError):
        usable = [str(isa) for isa in probed()]  # (the probe, this once)
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps({"listed": listed, "usable": usable, "machine": machine}))
        partial.replace(record)
    if usable == listed:
        config.cpp.vec_isa_ok = True
