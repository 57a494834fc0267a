import json

import pytest
import torch

import sparsegen
from sparsegen.cli import main
from sparsegen.eval.perplexity import window_perplexity
from sparsegen.eval.stream import make_streams, read_tokens, recompute_nll, stream_nll
from sparsegen.kv import make_policy
from sparsegen.models.compat import cache_kwargs


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    return sparsegen.load(tiny_checkpoint)


def test_read_tokens_in_blocks_matches_whole_file(tmp_path, tiny_tokenizer):
    text = "".join(f"Paragraph {i}: it was the best of times.\n\n" for i in range(300))
    path = tmp_path / "t.txt"
    path.write_text(text)
    whole = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    got = read_tokens(path, tiny_tokenizer, 10_000, block_chars=500)
    assert got.tolist() == whole
    assert read_tokens(path, tiny_tokenizer, 37, block_chars=500).tolist() == whole[:37]


def test_streams_are_equal_length_rows_with_bos(corpus, tiny_tokenizer):
    data = make_streams(corpus / "books" / "train", tiny_tokenizer, total_tokens=200, bos_id=0)
    assert data.shape == (2, 101) and (data[:, 0] == 0).all()
    one_file = make_streams(corpus / "books" / "test", tiny_tokenizer, total_tokens=90, streams=3)
    assert one_file.shape == (3, 30)


def test_stream_full_equals_windows_when_the_text_fits(model_and_tokenizer, corpus):
    model, tokenizer = model_and_tokenizer
    data = make_streams(corpus / "books" / "test", tokenizer, total_tokens=100, streams=1, bos_id=0)
    streamed = stream_nll(model, data, make_policy("full"), progress=False).summary(segment=50)
    windowed = window_perplexity(model, [data[0, 1:].numpy()], ctx=101, bos_id=0, progress=False)
    assert streamed["tokens"] == windowed["tokens"] == 100
    assert streamed["ppl"] == pytest.approx(windowed["ppl"], rel=1e-6)


def test_stream_policy_matches_token_by_token_generation_cache(model_and_tokenizer):
    """stream_nll with a policy scores exactly what a manual loop with that policy's cache predicts."""
    model, _ = model_and_tokenizer
    data = torch.randint(2, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    result = stream_nll(model, data, make_policy("streaming", 8, sinks=2), progress=False)
    cache = sparsegen.kv.EvictionCache(model, make_policy("streaming", 8, sinks=2))
    with torch.no_grad():
        for t in range(39):
            logits = model(input_ids=data[:, t:t + 1], **cache_kwargs(cache)).logits[:, -1]
            expected = torch.nn.functional.cross_entropy(logits, data[:, t + 1], reduction="none")
            assert torch.allclose(result.nll[:, t].float(), expected, atol=1e-5)
    assert result.summary(10)["kv_tokens_peak"] == 39  # the whole stream went in one chunk


def test_chunked_streaming_equals_one_token_at_a_time(model_and_tokenizer):
    model, _ = model_and_tokenizer
    data = torch.randint(2, 200, (3, 90), generator=torch.Generator().manual_seed(2))
    for name, options in [("streaming", {"sinks": 2}), ("h2o", {}), ("streaming-h2o", {"sinks": 1})]:
        chunked = stream_nll(model, data, make_policy(name, 10, **options), chunk=32, progress=False)
        single = stream_nll(model, data, make_policy(name, 10, **options), chunk=1, progress=False)
        assert (chunked.nll - single.nll).abs().max() <= 1e-5, name
        assert chunked.cache["kv_tokens_peak"] == 10 + 32 and single.cache["kv_tokens_peak"] == 11


def test_recompute_reencodes_the_last_window(model_and_tokenizer):
    model, _ = model_and_tokenizer
    data = torch.randint(2, 200, (2, 30), generator=torch.Generator().manual_seed(1))
    result = recompute_nll(model, data, window=6, batch_size=4, progress=False)
    with torch.no_grad():
        for t in (0, 3, 5, 17, 28):
            lo = max(0, t - 5)
            logits = model(input_ids=data[:, lo:t + 1]).logits[:, -1]
            expected = torch.nn.functional.cross_entropy(logits, data[:, t + 1], reduction="none")
            assert torch.allclose(result.nll[:, t].float(), expected, atol=1e-5)


def test_ppl_cli_json_csv_and_plot(tiny_checkpoint, corpus, tmp_path):
    out, csv, png = tmp_path / "out.json", tmp_path / "seg.csv", tmp_path / "plot.png"
    args = ["ppl", "--model", str(tiny_checkpoint), "--text", str(corpus / "books" / "test"), "--stream",
            "--policy", "streaming", "--sinks", "2", "--budget", "16", "--max-tokens", "120", "--segment", "40",
            "--every", "10", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert {"ppl", "tokens", "kv_tokens_peak", "segments"} <= set(report)
    assert report["kv_tokens_peak"] <= 16 + 120 and len(report["segments"]) == 3
    trace = report["trace"]  # KV held, process memory and time, sampled every 10 tokens
    assert trace["every"] == 10 and len(trace["kv_bytes"]) == len(trace["rss_bytes"]) == len(trace["seconds"]) == 12
    assert 0 < max(trace["kv_bytes"]) <= report["kv_bytes_peak"] and min(trace["rss_bytes"]) > 0
    assert trace["seconds"] == sorted(trace["seconds"])
    args = args[:-2] + ["--policy", "full", "--policy", "recompute", "--json", str(out), "--csv", str(csv),
                        "--plot", str(png)]
    assert main(args) == 0
    assert [p["label"] for p in json.loads(out.read_text())["policies"]] == ["streaming", "full", "recompute-16"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert csv.read_text().splitlines()[0] == "policy,start,end,ppl"


def test_ppl_cli_windows(tiny_checkpoint, corpus, tmp_path):
    out = tmp_path / "w.json"
    assert main(["ppl", "--model", str(tiny_checkpoint), "--text", str(corpus / "books" / "test"), "--windows",
                 "--ctx", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "windows" and report["ppl"] > 1 and report["tokens"] > 0
    assert main(["ppl", "--model", str(tiny_checkpoint), "--text", str(corpus)]) == 2  # neither mode given
