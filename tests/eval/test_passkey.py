import json

import numpy as np
import pytest

import sparsegen
from sparsegen.cli import main
from sparsegen.eval.passkey import INTRO, NEEDLE, QUESTION, build_prompt, passkey_accuracy
from sparsegen.eval.protocols import PROTOCOLS
from sparsegen.kv import PolicySpec


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    return sparsegen.load(tiny_checkpoint)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_sits_at_the_requested_depth(tiny_tokenizer, depth):
    filler = np.arange(2, 5000) % 250 + 2
    ids, at = build_prompt(tiny_tokenizer, filler, length=300, depth=depth, key=12345)
    encode = lambda text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = [tiny_tokenizer.bos_token_id] + encode(INTRO)
    needle, tail = encode(NEEDLE.format(key=12345)), encode(QUESTION)
    room = 300 - len(head) - len(needle) - len(tail)
    assert len(ids) == 300
    assert ids[:len(head)] == head and ids[-len(tail):] == tail
    assert ids[at:at + len(needle)] == needle
    assert at - len(head) == round(depth * room)  # haystack tokens before the needle


def test_depth_is_proportional(tiny_tokenizer):
    filler = np.arange(2, 5000) % 250 + 2
    positions = [build_prompt(tiny_tokenizer, filler, 400, d, 11111)[1] for d in (0.0, 0.5, 1.0)]
    assert positions[0] < positions[1] < positions[2]
    assert positions[1] - positions[0] == pytest.approx((positions[2] - positions[0]) / 2, abs=1)


def test_accuracy_counts_answers_that_hold_the_hidden_key(model_and_tokenizer, monkeypatch):
    """A stand-in model that reads the key out of each prompt and answers it in every other row: half right."""
    import re

    import torch

    import sparsegen.eval.passkey as passkey

    model, tokenizer = model_and_tokenizer

    def answer(model, ids, *args, **kwargs):
        keys = [re.search(r"pass key is (\d{5})", tokenizer.decode(row)).group(1) for row in ids.tolist()]
        texts = [f" {key}." if i % 2 == 0 else f" {int(key) % 99999 + 1:05d}." for i, key in enumerate(keys)]
        width = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        new = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        new = torch.tensor([row + [tokenizer.eos_token_id] * (width - len(row)) for row in new])
        return new, None, {"kv_tokens_peak": ids.shape[1]}

    monkeypatch.setattr(passkey, "generate_tokens", answer)
    filler = np.arange(2, 5000) % 250 + 2
    result = passkey_accuracy(model, tokenizer, filler, [200], [0.0, 0.5, 1.0], PolicySpec(),
                              trials=4, progress=False)
    assert [c["accuracy"] for c in result["cells"]] == [0.5, 0.5, 0.5] and result["accuracy"] == 0.5


def test_bad_requests(tiny_tokenizer):
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tiny_tokenizer, np.arange(1000), 300, 1.5, 12345)
    with pytest.raises(ValueError, match="cannot hold"):
        build_prompt(tiny_tokenizer, np.arange(1000), 10, 0.5, 12345)
    with pytest.raises(ValueError, match="haystack text has 5 tokens"):
        build_prompt(tiny_tokenizer, np.arange(5), 300, 0.5, 12345)


def test_accuracy_grid_and_cli(model_and_tokenizer, tiny_checkpoint, corpus, tmp_path):
    model, tokenizer = model_and_tokenizer
    filler = np.arange(2, 5000) % 250 + 2
    result = passkey_accuracy(model, tokenizer, filler, [200, 260], [0.0, 1.0], PolicySpec(),
                              trials=2, progress=False)
    assert [(c["length"], c["depth"]) for c in result["cells"]] == [(200, 0.0), (200, 1.0), (260, 0.0), (260, 1.0)]
    assert all(len(c["answers"]) == 2 and len(c["keys"]) == 2 for c in result["cells"])
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["passkey", "--model", str(tiny_checkpoint), "--text", str(corpus / "books/test/c.txt"),
                 "--policy", "full", "--policy", "streaming", "--budget", "64", "--lengths", "200",
                 "--chunk-size", "64",
                 "--depths", "0,0.5", "--trials", "2", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())["policies"]
    assert set(report) == {"full", "streaming"} and report["streaming"]["cells"][0]["kv_tokens_peak"] <= 64 + 64
    assert png.read_bytes()[:4] == b"\x89PNG"


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def chat_tokenizer(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = CHAT
    return tokenizer


def test_an_instruct_model_is_asked_in_its_chat_template(chat_tokenizer):
    from sparsegen.eval.passkey import ANSWER, ASK, chat_frame, describe_prompt

    assert chat_frame(chat_tokenizer) == ("<|user|>", "<|end|><|assistant|>")
    filler = np.arange(2, 5000) % 250 + 2
    ids, at = build_prompt(chat_tokenizer, filler, length=300, depth=0.5, key=54321, chat=True)
    encode = lambda text: chat_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, tail = encode("<|user|>" + INTRO), encode(ASK + "<|end|><|assistant|>" + ANSWER)
    assert len(ids) == 300 and ids[:len(head)] == head and ids[-len(tail):] == tail
    assert ids[at:at + len(encode(NEEDLE.format(key=54321)))] == encode(NEEDLE.format(key=54321))
    assert describe_prompt(chat_tokenizer, True).startswith("<|user|>" + INTRO + "{haystack}")


def test_a_template_that_rewrites_the_message_is_refused(chat_tokenizer):
    from sparsegen.eval.passkey import chat_frame

    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="--no-chat"):
        chat_frame(chat_tokenizer)


def test_chat_is_refused_for_a_model_without_a_template(tiny_checkpoint, corpus, capsys):
    assert main(["passkey", "--model", str(tiny_checkpoint), "--text", str(corpus / "books/test/c.txt"),
                 "--lengths", "200", "--depths", "0", "--trials", "1", "--chat"]) != 0
    assert "no chat template" in capsys.readouterr().err


def test_the_context_protocol_holds_the_haystack_once_and_changes_nothing_under_the_full_cache(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    filler = np.arange(2, 5000) % 250 + 2
    run = {(name, protocol): passkey_accuracy(model, tokenizer, filler, [240], [0.5],
                                              PolicySpec.sharing(name, 64),
                                              trials=2, progress=False, chunk_size=32, protocol=protocol)["cells"][0]
           for name in ("full", "streaming") for protocol in PROTOCOLS}
    answers = [run["full", protocol]["answers"] for protocol in PROTOCOLS]
    assert all(a == answers[0] for a in answers[1:]), answers
    streamed, whole = run["streaming", "stream"], run["streaming", "context"]
    assert streamed["kv_tokens_peak"] <= 64 + 32 < 200 <= whole["kv_tokens_peak"]
    assert run["streaming", "query-aware"]["kv_tokens_peak"] == 240  # the whole prompt, question included, at once
    # context-once encodes the context in one pass too (then holds the cache: nothing more is evicted)
    assert run["streaming", "context-once"]["kv_tokens_peak"] == run["streaming", "context"]["kv_tokens_peak"]
    with pytest.raises(ValueError, match="protocol"):
        passkey_accuracy(model, tokenizer, filler, [240], [0.5], PolicySpec(), protocol="once")
