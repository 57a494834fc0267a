import numpy as np
import pytest

from sparsegen.models import ModelLoadError
from sparsegen.models import gguf as files


def _written(path, vocabulary: int = 300) -> None:
    """A GGUF file with metadata of every shape a real one has (strings, arrays of strings and numbers, an array of
    arrays, booleans, floats) before tensors of several stored types."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_uint64("llama.context_length", 2048)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7) for i in range(vocabulary)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(vocabulary)])
    writer.add_array("nested", [[1, 2], [3]])
    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("token_embd.weight", rows)
    writer.add_tensor("blk.0.attn_q.weight", rows.astype(np.float16))
    writer.add_tensor("blk.0.ffn_down.weight", quantize(rows, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("read", [files.HEADER_READ, 7])  # (7 bytes a read: every item crosses a read)
def test_a_gguf_files_tensor_types_read_from_its_header_are_the_gguf_readers(tmp_path, monkeypatch, read):
    from gguf import GGUFReader

    monkeypatch.setattr(files, "HEADER_READ", read)
    _written(tmp_path / "tiny.gguf")
    expected = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "tiny.gguf")).tensors}
    assert files.tensor_types(tmp_path / "tiny.gguf") == expected
    assert expected == {"token_embd.weight": "F32", "blk.0.attn_q.weight": "F16", "blk.0.ffn_down.weight": "Q8_0"}


def test_a_truncated_or_foreign_file_says_so(tmp_path):
    _written(tmp_path / "tiny.gguf")
    whole = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:len(whole) // 20])
    with pytest.raises(ModelLoadError, match="truncated"):
        files.tensor_types(tmp_path / "cut.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + whole[4:])
    with pytest.raises(ModelLoadError, match="not a little-endian GGUF"):
        files.tensor_types(tmp_path / "other.gguf")


def test_smollm2s_tensor_types_are_the_gguf_readers():
    from gguf import GGUFReader

    try:
        path = files.gguf_file("smollm2")
    except ModelLoadError as err:
        pytest.skip(str(err))
    assert files.tensor_types(path) == {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
