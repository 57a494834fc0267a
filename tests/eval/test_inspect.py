"""The cache inspector: its kept sets are the caches' own, its page draws them, and a browser renders the page."""

import json
import shutil

import pytest
import torch

import sparsegen
from sparsegen.engine.prefill import prefill
from sparsegen.eval.inspect import answer_tokens, inspect, page, write_html
from sparsegen.kv import EvictionCache, make_policy
from tests.kv.families import named_policies

TEXT = ("The old house stood by the river. The pass key is 4417. Remember it. " + "The grass is green. " * 30)
QUESTION = " What is the pass key? The pass key is"


@pytest.fixture(scope="module")
def reference():
    return sparsegen.load("reference")


@pytest.fixture(scope="module")
def inspected(reference):
    model, tokenizer = reference
    return inspect(model, tokenizer, TEXT, list(named_policies()), budget=48, question=QUESTION, answer="4417",
                   max_new_tokens=4)


def test_kept_sets_are_the_caches_own(reference, inspected):
    model, tokenizer = reference
    ids = torch.tensor([tokenizer(TEXT + QUESTION)["input_ids"]])
    assert inspected["prompt_tokens"] == ids.shape[1] == len(inspected["tokens"])
    for name in inspected["policies"]:  # every registered policy
        cache = EvictionCache(model, make_policy(name, None if name == "full" else 48))
        prefill(model, cache, ids, torch.ones_like(ids), 512)
        row = inspected["policies"][name]
        for layer, per_head in zip(cache.layers, row["kept"]):
            assert sum(map(len, per_head)) == int(layer.valid[0, :, :layer.used].sum())
            if layer.head is None:
                for head, held in enumerate(per_head):
                    assert held == sorted(layer.index[0, head, :layer.used][layer.valid[0, head, :layer.used]].tolist())
        assert row["count"] == [sum(token in held for per_head in row["kept"] for held in per_head)
                                for token in range(ids.shape[1])]
        held = cache.held_tokens()
        assert row["kv_tokens"] == max(held)
        if name == "kvzip-global":  # (one budget for the model: a layer holds what its tokens won)
            assert sum(held) <= 48 * len(held) < ids.shape[1] * len(held)
        elif name != "full":
            assert max(held) <= (48 * 2 if name == "pyramid" else 48)
        assert all(row["score"][t] is None for t in range(ids.shape[1]) if row["count"][t] == 0)
    full = inspected["policies"]["full"]
    assert full["count"] == [inspected["layers"] * inspected["heads"]] * ids.shape[1] and full["answer_kept"] == 1.0
    window = inspected["policies"]["window"]
    assert window["count"][-48:] == [inspected["layers"] * inspected["heads"]] * 48 and sum(window["count"][:-48]) == 0
    streaming = inspected["policies"]["streaming"]
    assert all(streaming["count"][t] > 0 for t in range(4))  # the sinks
    assert all(streaming["protected"][t] for t in range(4))


def test_answer_tokens_and_sink_mass(reference, inspected):
    model, tokenizer = reference
    needed = inspected["answer_tokens"]
    assert needed and "4417" in "".join(inspected["tokens"][t] for t in needed).replace(" ", "")
    assert inspected["policies"]["window"]["answer_kept"] == 0.0  # long gone from a window of 48
    assert inspected["policies"]["streaming"]["answer_kept"] == 0.0
    assert len(inspected["sink_mass"]) == inspected["layers"]
    assert all(0 < share < 1 for share in inspected["sink_mass"])
    assert answer_tokens([(0, 3), (3, 7)], "abcdefg", "zz") == []
    assert answer_tokens([(0, 2), (2, 4), (4, 6)], "abxxab", "ab") == [0, 2]
    assert all(isinstance(row["reply"], str) for row in inspected["policies"].values())


def test_bad_input_is_refused(reference):
    model, tokenizer = reference
    with pytest.raises(ValueError, match="unknown policy teleport"):
        inspect(model, tokenizer, TEXT, "window,teleport", budget=8)
    with pytest.raises(ValueError, match="give a question"):
        inspect(model, tokenizer, TEXT, "window", budget=8, protocol="context")
    with pytest.raises(ValueError, match="non-empty"):
        inspect(model, tokenizer, "", "window", budget=8)


def test_the_page_is_self_contained_and_embeds_the_data(inspected, tmp_path):
    html = write_html(inspected, tmp_path / "out.html").read_text()
    assert "http://" not in html and "https://" not in html and "<link" not in html and "src=" not in html
    assert json.dumps(inspected["sink_mass"], separators=(",", ":")) in html
    hostile = dict(inspected, question="</script><script>alert(1)</script>")
    assert "</script><script>alert" not in page(hostile)
    assert "const API = true" in page(api=True) and "const DATA = null" in page(api=True)


def test_the_cli_writes_html_json_and_png(tmp_path, capsys):
    from sparsegen.cli import main

    prompt = tmp_path / "prompt.txt"
    prompt.write_text(TEXT)
    code = main(["inspect", "--model", "reference", "--policies", "window,h2o", "--budget", "32", "--prompt-file",
                 str(prompt), "--question", QUESTION, "--answer", "4417", "--html", str(tmp_path / "o.html"),
                 "--json", str(tmp_path / "o.json"), "--png", str(tmp_path / "o.png"), "--max-new-tokens", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "window" in printed and "h2o" in printed
    data = json.loads((tmp_path / "o.json").read_text())
    assert set(data["policies"]) == {"window", "h2o"}
    assert (tmp_path / "o.html").stat().st_size > 1000 and (tmp_path / "o.png").stat().st_size > 1000


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.browser
@pytest.mark.skipif(BROWSER is None, reason="no Chromium (apt-get install chromium; .ci/run installs it)")
def test_a_browser_renders_the_served_inspector(reference, tmp_path):
    """Headless Chromium loads /inspect from a running server (with an API key), submits a text, and the page
    shows each policy's tokens with the library's kept counts; a screenshot is kept for the docs."""
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra has it)")
    from sparsegen.serve.schemas import Limits
    from tests.serve.test_server import Running

    model, tokenizer = reference
    expected = inspect(model, tokenizer, TEXT, "window,streaming,h2o,snapkv", budget=48, question=QUESTION,
                       answer="4417", max_new_tokens=16, chunk_size=32)  # the server's chunks and reply length
    running = Running(model, tokenizer, Limits(max_sessions=2, max_batch=2, max_tokens=64, api_keys=("k1",)))
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=BROWSER, args=["--no-sandbox"])
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.goto(f"{running.url}/inspect")
            tab.fill("#f-text", TEXT)
            tab.fill("#f-question", QUESTION)
            tab.fill("#f-answer", "4417")
            tab.fill("#f-policies", "window,streaming,h2o,snapkv")
            tab.fill("#f-budget", "48")
            tab.fill("#f-key", "k1")
            tab.click("#f-run")
            tab.wait_for_selector("#out[data-ready='1']", timeout=60_000)
            for name, row in expected["policies"].items():
                counts = tab.eval_on_selector_all(f".text[data-policy='{name}'] .tok", "s => s.map(x => "
                                                                                       "+x.dataset.count)")
                assert counts == row["count"], name
                shown = tab.inner_text(f"#policies tr[data-policy='{name}'] .kv-tokens")
                assert int(shown) == row["kv_tokens"]
                assert tab.inner_text(f"#policies tr[data-policy='{name}'] .reply") == row["reply"].strip()
            answers = tab.eval_on_selector_all(".text[data-policy='h2o'] .tok.answer", "s => s.map(x => +x.dataset.i)")
            assert answers == expected["answer_tokens"]
            tab.hover(f".text[data-policy='h2o'] .tok[data-i='{expected['answer_tokens'][0]}']")
            assert "h2o:" in tab.inner_text("#tip") and "layers" in tab.inner_text("#tip")
            tab.screenshot(path=str(tmp_path / "inspect.png"), full_page=True)
            assert (tmp_path / "inspect.png").stat().st_size > 10_000
            tab.fill("#f-key", "wrong")
            tab.click("#f-run")
            tab.wait_for_function("document.getElementById('status').textContent.includes('API key')")
            browser.close()
    finally:
        running.stop()


def test_quantized_kv_and_the_context_protocol(reference):
    """--kv-bits and --protocol context: the kept sets are still the caches' own."""
    model, tokenizer = reference
    data = inspect(model, tokenizer, TEXT, "h2o", budget=32, question=QUESTION, kv_bits=4, protocol="context",
                   max_new_tokens=0)
    ids = torch.tensor([tokenizer(TEXT + QUESTION)["input_ids"]])
    context = len(tokenizer(TEXT)["input_ids"])
    cache = EvictionCache(model, make_policy("h2o", 32), kv_bits=4)
    prefill(model, cache, ids, torch.ones_like(ids), 512, first_chunk=context)
    kept = data["policies"]["h2o"]["kept"]
    for layer, per_head in zip(cache.layers, kept):
        for head, held in enumerate(per_head):
            assert held == sorted(layer.index[0, head, :layer.used][layer.valid[0, head, :layer.used]].tolist())
    assert data["kv_bits"] == 4 and data["policies"]["h2o"]["reply"] == ""
