"""Compressed contexts: compressed once, asked many times, saved and loaded, refused by another model."""

import json

import pytest
import torch

import sparsegen
from sparsegen.engine.context import CompressedContext, model_fingerprint
from sparsegen.engine.prefill import prefill
from sparsegen.engine.step import DecodeStep
from sparsegen.kv import EvictionCache, PolicySpec, make_policy
from tests.engine.test_reconstruct import sharpened
from tests.kv.families import VOCAB, tiny_model

CONTEXT = " ".join(["it was the best of times, it was the worst of times, it was the age of wisdom"] * 4)
QUESTIONS = [" it was the season of", " the age of"]
POLICIES = [("full", None, None), ("streaming", 16, None), ("h2o", 0.3, None), ("snapkv", 0.25, None),
            ("h2o", 0.3, 4), ("adakv", 0.3, None), ("pyramid", 24, None), ("kvzip", 0.3, None), ("kvzip", 0.3, 4),
            ("kvzip-heads", 0.3, None), ("kvzip-global", 0.3, None), ("kvzip-global", 0.3, 4),
            ("expected-attention", 0.3, None)]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    return sparsegen.load(tiny_checkpoint)


@pytest.mark.parametrize("policy,budget,kv_bits", POLICIES)
def test_a_compressed_context_answers_as_the_context_protocol_does(model_and_tokenizer, policy, budget, kv_bits):
    """The same tokens as compressing the context inside each generate, for every question asked of one context."""
    model, tokenizer = model_and_tokenizer
    spec = PolicySpec(policy, budget, kv_bits=kv_bits)
    compressed = sparsegen.compress(model, tokenizer, CONTEXT, spec)
    for question in QUESTIONS:
        each = sparsegen.generate(model, tokenizer, policy=spec, context=CONTEXT, question=question, max_new_tokens=6,
                                  stop_at_eos=False)
        once = sparsegen.generate(model, tokenizer, context=compressed, question=question, max_new_tokens=6,
                                  stop_at_eos=False)
        assert once.texts == each.texts
        assert once.prompt_tokens == each.prompt_tokens
        assert once.cache["kv_tokens"] == each.cache["kv_tokens"]
    if budget is not None:
        assert compressed.held_tokens < compressed.tokens


def test_the_full_context_continues_the_models_own_generation(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    compressed = sparsegen.compress(model, tokenizer, CONTEXT)
    ids = tokenizer(CONTEXT)["input_ids"] + tokenizer(QUESTIONS[0], add_special_tokens=False)["input_ids"]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    got = sparsegen.generate(model, tokenizer, context=compressed, question=QUESTIONS[0], max_new_tokens=8,
                             stop_at_eos=False)
    assert got.texts == [tokenizer.decode(expected[0, len(ids):], skip_special_tokens=True)]


@pytest.mark.parametrize("policy", ["kvzip", "kvzip-global"])
def test_a_question_reports_its_own_peak_not_the_compressions(model_and_tokenizer, policy):
    """KVzip holds the whole context and a copy of it while it compresses; the answer's K/V peak is what it held."""
    model, tokenizer = model_and_tokenizer
    compressed = sparsegen.compress(model, tokenizer, CONTEXT, PolicySpec(policy, 0.3))
    answer = sparsegen.generate(model, tokenizer, context=compressed, question=QUESTIONS[0], max_new_tokens=4,
                                stop_at_eos=False)
    question = len(tokenizer(QUESTIONS[0], add_special_tokens=False)["input_ids"])
    assert answer.cache["kv_tokens_peak"] <= compressed.held_tokens + question + 4 < compressed.tokens


def test_save_and_load_round_trip(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    compressed = sparsegen.compress(model, tokenizer, CONTEXT, PolicySpec("h2o", 0.3, kv_bits=4))
    path = compressed.save(tmp_path / "doc.safetensors")
    assert not list(tmp_path.glob("*.partial"))
    loaded = CompressedContext.load(path, model)
    assert loaded.meta == compressed.meta
    assert loaded.tensors.keys() == compressed.tensors.keys()
    assert all(torch.equal(loaded.tensors[k], compressed.tensors[k]) for k in compressed.tensors)
    assert loaded.describe()["policy"] == "h2o" and loaded.describe()["kv_bits"] == 4
    a = sparsegen.generate(model, tokenizer, context=loaded, question=QUESTIONS[0], max_new_tokens=6)
    b = sparsegen.generate(model, tokenizer, context=compressed, question=QUESTIONS[0], max_new_tokens=6)
    assert a.texts == b.texts


def test_another_model_or_a_bad_file_is_refused(model_and_tokenizer, tiny_checkpoint, tmp_path):
    model, tokenizer = model_and_tokenizer
    path = sparsegen.compress(model, tokenizer, CONTEXT, policy="streaming", budget=16).save(tmp_path / "c.safetensors")
    other, _ = sparsegen.load(tiny_checkpoint)
    assert model_fingerprint(other) == model_fingerprint(model)  # the same checkpoint loaded again
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    with pytest.raises(ValueError, match="another model"):
        CompressedContext.load(path, other)
    loaded = CompressedContext.load(path)  # no model: read only
    with pytest.raises(ValueError, match="another model"):
        sparsegen.generate(other, tokenizer, context=loaded, question=QUESTIONS[0])
    with pytest.raises(FileNotFoundError, match="sparsegen compress"):
        CompressedContext.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a sparsegen compressed context"):
        CompressedContext.load(tmp_path / "other.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "old.safetensors"),
              metadata={"sparsegen": json.dumps({"format": "sparsegen.compressed_context/1"})})
    with pytest.raises(ValueError, match="another sparsegen version.*compress the context again"):
        CompressedContext.load(tmp_path / "old.safetensors")
    with pytest.raises(ValueError, match="NAME.safetensors"):
        loaded.save(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="carries its policy.*budget"):
        sparsegen.generate(model, tokenizer, context=loaded, question="x", policy="h2o", budget=8)
    with pytest.raises(ValueError, match="question"):
        sparsegen.generate(model, tokenizer, context=loaded)


@pytest.mark.parametrize("family,name", [("gemma3", "h2o"), ("qwen2", "h2o"), ("qwen2", "expected-attention")])
def test_restored_caches_continue_as_the_original(family, name):
    """Token level, on a model with sliding-window layers too: a restored snapshot decodes what the cache it was
    taken from decodes."""
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    policy = make_policy(name, 12)
    original = EvictionCache(model, policy)
    prefill(model, original, ids, torch.ones_like(ids), 64, first_chunk=40)
    restored = CompressedContext.of(model, original, ids).cache(model)
    assert restored.held_tokens() == original.held_tokens()
    step = DecodeStep(model)
    logits = [prefill(model, cache, question, torch.ones_like(question), 64, start=40)
              for cache in (original, restored)]
    for position in range(45, 53):  # past the budget: evictions by the restored scores
        assert torch.equal(logits[0], logits[1])
        token = logits[0].argmax(-1)
        logits = [step(cache, token, torch.tensor([position])) for cache in (original, restored)]
    assert restored.held_tokens() == original.held_tokens() and max(original.held_tokens()) == 12
    for a, b in zip(original.layers, restored.layers):  # the same slots, scores and positions after evicting
        for (buffer, x), (_, y) in zip(a.buffers(), b.buffers()):
            assert torch.equal(x[:, :, :a.used], y[:, :, :b.used]), buffer
        for (state, x), (_, y) in zip(a.row_state(), b.row_state()):  # (expected-attention: the queries' moments)
            assert torch.equal(x, y), state


def test_nothing_evicted_after_the_context_when_asked(model_and_tokenizer):
    """evict_after_context=False: kvpress's exact protocol, from a text context or a compressed one alike."""
    model, tokenizer = model_and_tokenizer
    compressed = sparsegen.compress(model, tokenizer, CONTEXT, policy="knorm", budget=16)
    common = dict(question=QUESTIONS[0], max_new_tokens=6, stop_at_eos=False, evict_after_context=False)
    once = sparsegen.generate(model, tokenizer, context=compressed, **common)
    text = sparsegen.generate(model, tokenizer, context=CONTEXT, policy="knorm", budget=16, **common)
    assert once.texts == text.texts
    question = len(tokenizer(QUESTIONS[0], add_special_tokens=False)["input_ids"])
    assert once.cache["kv_tokens"] == text.cache["kv_tokens"] == 16 + question + 5
    held = sparsegen.generate(model, tokenizer, context=compressed, question=QUESTIONS[0], max_new_tokens=6)
    assert held.cache["kv_tokens"] == 16
    pooled = sparsegen.generate(model, tokenizer, context=CONTEXT, policy="adakv", budget=16, **common)
    assert pooled.cache["kv_tokens"] == 16 + question + 5  # (heads sharing their slots: the pool grows)


@torch.inference_mode()
def test_a_saved_kvzip_global_context_keeps_each_layers_budget(tmp_path):
    """The model-wide KVzip gives each layer its own share: saved and loaded, each layer keeps it, and decoding past
    it evicts as the original does."""
    model = sharpened(tiny_model("llama"))
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    original = EvictionCache(model, make_policy("kvzip-global", 12), chunk_size=16)
    prefill(model, original, ids, torch.ones_like(ids), 16, first_chunk=40)
    budgets = [layer.policy.budget for layer in original.layers]
    assert budgets[0] != budgets[1]
    path = CompressedContext.of(model, original, ids).save(tmp_path / "context.safetensors")
    restored = CompressedContext.load(path, model).cache(model)
    assert [layer.policy.budget for layer in restored.layers] == budgets
    step, token = DecodeStep(model), torch.tensor([5])
    for position in range(40, 60):  # (past every layer's budget)
        logits = [step(cache, token, torch.tensor([position])) for cache in (original, restored)]
        assert torch.equal(logits[0], logits[1])
        token = logits[0].argmax(-1)
    assert restored.held_tokens() == original.held_tokens() == budgets


@torch.inference_mode()
@pytest.mark.parametrize("name", ["adakv", "kvzip-heads", "kvzip-global"])
def test_heads_sharing_their_slots_hold_what_follows_the_context_as_the_full_cache(name):
    """kvpress's protocol under per-head budgets: a context the budget holds, then nothing evicted as the question
    and the answer go past the budget: the full cache's logits, step after step."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    caches = [EvictionCache(model, make_policy("full")), EvictionCache(model, make_policy(name, 40))]
    for cache in caches:
        prefill(model, cache, ids, torch.ones_like(ids), 16, first_chunk=40)
        cache.stop_evicting()
    logits = [prefill(model, cache, question, torch.ones_like(question), 16, start=40) for cache in caches]
    step = DecodeStep(model)
    for position in range(49, 57):
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        token = logits[0].argmax(-1)
        logits = [step(cache, token, torch.tensor([position])) for cache in caches]
    assert caches[1].held_tokens() == caches[0].held_tokens() == [57, 57]


def _damaged_copies(path, folder) -> dict:
    """Damaged variants of the saved context at ``path``: what a crash, a disk or a hand edit leaves."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["sparsegen"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    files = {"truncated": raw[:len(raw) // 2], "empty": b"", "random": bytes(range(256)) * 16,
             "header": raw[:8] + b"}" * 16 + raw[24:]}
    for name, content in files.items():
        (folder / f"{name}.safetensors").write_bytes(content)

    def write(name, tensors=tensors, **changes):
        edited = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        save_file(tensors, str(folder / f"{name}.safetensors"), metadata={"sparsegen": json.dumps(edited)})

    for key in ("fingerprint", "policy", "kv_quantization", "positions", "layers", "length", "chunk_size", "text"):
        write(f"no-{key}", **{key: None}, digest=None)
    save_file(tensors, str(folder / "list.safetensors"), metadata={"sparsegen": json.dumps([meta])})
    write("length-1e12", length=10**12, digest=None)
    write("layers-not-counts", layers=[{"used": "x"}] * len(meta["layers"]), digest=None)
    write("policy-unknown", policy={"policy": "nope", "budget": 3}, digest=None)
    write("layer-budget", layers=[{**layer, "budget": 3} for layer in meta["layers"]], digest=None)  # (uniform)
    write("layer-budget-0", layers=[{**layer, "budget": 0} for layer in meta["layers"]], digest=None)
    keys = "layers.0.keys"
    write("shape", {**tensors, keys: tensors[keys][:, :, :3].contiguous()}, digest=None)
    write("dtype", {**tensors, keys: tensors[keys].double()}, digest=None)
    write("missing-layer", {k: v for k, v in tensors.items() if not k.startswith("layers.1.")}, digest=None)
    write("extra-tensor", {**tensors, "layers.9.keys": tensors[keys].clone()}, digest=None)
    nan = tensors[keys].clone()
    nan[0, 0, 0, 0] = float("nan")
    write("nan", {**tensors, keys: nan}, digest=None)
    flipped = tensors[keys].clone()
    flipped.view(torch.uint8)[0, 0, 0, 0] ^= 0x10
    write("flipped", {**tensors, keys: flipped})  # the digest it was saved with
    return {p.stem: p for p in folder.glob("*.safetensors")}


def test_a_damaged_file_is_refused_whole_at_load_in_one_line(model_and_tokenizer, tmp_path, capsys):
    """Truncated, random or edited files stopped ``serve`` with a traceback, or started and answered made-up text."""
    model, tokenizer = model_and_tokenizer
    good = sparsegen.compress(model, tokenizer, CONTEXT, policy="h2o", budget=16).save(tmp_path / "good.safetensors")
    assert CompressedContext.load(good, model).tokens > 16
    (tmp_path / "bad").mkdir()
    damaged = _damaged_copies(good, tmp_path / "bad")
    assert len(damaged) == 24
    for name, path in damaged.items():
        with pytest.raises(ValueError) as err:
            CompressedContext.load(path, model)
        message = str(err.value)
        assert str(path) in message and "\n" not in message, name
        if name != "list":
            assert "sparsegen compress" in message, name
    from sparsegen.cli import main

    capsys.readouterr()
    assert main(["serve", "--model", model.config._name_or_path, "--policy", "h2o", "--budget", "16",
                 "--context", f"doc={damaged['truncated']}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("sparsegen serve: error: ")
    assert "truncated.safetensors" in errors[0]

