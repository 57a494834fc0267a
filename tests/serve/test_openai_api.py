"""The requests OpenAI clients really send, through the official ``openai`` client (sync, async, streaming) and raw
HTTP: content-part lists, the developer role, null assistant content, list prompts, log-probabilities, model lookup,
and a clear 400 in OpenAI's shape for each field this server does not honour."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest
import torch

from sparsegen.serve.schemas import REFUSED, Limits
from tests.serve.test_server import BUDGET, Running, reference  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", params=["one process", "ray serve"])
def server(request, reference):
    """The same server in one process, and as 2 replicas on Ray Serve (``serve --ray``): every test runs on both."""
    if request.param == "ray serve":
        from tests.serve.test_replicas import deployed

        with deployed(["--model", "reference", "--policy", "streaming", "--budget", str(BUDGET), "--chunk-size",
                       "32", "--max-sessions", "8", "--max-batch", "8", "--max-tokens-limit", "64",
                       "--max-new-tokens", "64"]) as url:
            yield SimpleNamespace(url=url)
        return
    running = Running(*reference, Limits(max_sessions=8, max_batch=8, max_tokens=64))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ask(client, messages, **extra):
    return client.chat.completions.create(model="reference", max_tokens=8, messages=messages, **extra)


def test_content_parts_the_developer_role_and_null_assistant_content_read_as_plain_text(client):
    plain = _ask(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                          {"role": "assistant", "content": ""}, {"role": "user", "content": "And Spain?"}])
    parts = _ask(client, [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                       {"type": "text", "text": " of France?"}]},
                          {"role": "assistant", "content": None}, {"role": "user", "content": "And Spain?"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("message,named", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "image_url"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "input_audio"),
    ({"role": "user", "content": None}, "needs content"),
    ({"role": "tool", "content": "42", "tool_call_id": "c1"}, "tool"),
])
def test_unreadable_messages_get_a_400_naming_what(client, message, named):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, [message])
    assert named in err.value.body["message"] and err.value.body["param"].startswith("messages.0")


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list()] == ["reference"]
    assert client.models.retrieve("reference").id == "reference"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"


def test_async_and_streamed_calls_with_usage(server, client):
    whole = _ask(client, [{"role": "user", "content": QUESTION}])

    async def streamed():
        async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = await async_client.chat.completions.create(
            model="reference", max_tokens=8, messages=[{"role": "user", "content": QUESTION}])
        chunks = [c async for c in await async_client.chat.completions.create(
            model="reference", max_tokens=8, messages=[{"role": "user", "content": QUESTION}], stream=True,
            stream_options={"include_usage": True})]
        await async_client.close()
        return reply, chunks

    reply, chunks = asyncio.run(streamed())
    assert reply.choices[0].message.content == whole.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices


def test_a_list_of_prompts_gets_one_choice_each_streamed_or_not(server, client):
    prompts = ["The sea was", "Once upon a time", "It was late"]
    alone = [client.completions.create(model="reference", prompt=p, max_tokens=6).choices[0].text for p in prompts]
    together = client.completions.create(model="reference", prompt=prompts, max_tokens=6)
    assert [c.index for c in together.choices] == [0, 1, 2] and [c.text for c in together.choices] == alone
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(model="reference", prompt=prompts, max_tokens=6, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == alone and finished == {0, 1, 2}
    with pytest.raises(openai.BadRequestError, match="one conversation"):
        client.completions.create(model="reference", prompt=prompts, max_tokens=6, extra_body={"session_id": "a"})


def test_log_probabilities_are_the_models_own(server, client, reference):
    model, tokenizer = reference
    reply = _ask(client, [{"role": "user", "content": QUESTION}], logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    assert "".join(e.token for e in entries).strip() == reply.choices[0].message.content.strip()
    # the first token's log-probability, recomputed from the model's logits over the rendered prompt
    from sparsegen.engine import ChatTemplate

    ids = tokenizer(ChatTemplate(tokenizer).render([{"role": "user", "content": QUESTION}]),
                    return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
    best = logprobs.topk(3)
    assert entries[0].logprob == pytest.approx(best.values[0].item(), abs=1e-3)  # greedy: the top token
    assert [t.logprob for t in entries[0].top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-3)
    streamed = [c for c in _ask(client, [{"role": "user", "content": QUESTION}], logprobs=True, top_logprobs=3,
                                stream=True) if c.choices and c.choices[0].logprobs]
    assert [e.logprob for c in streamed for e in c.choices[0].logprobs.content] == [e.logprob for e in entries]
    completion = client.completions.create(model="reference", prompt="The sea was", max_tokens=5, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0


def test_accepted_neutral_fields_and_any_64_bit_seed(client):
    reply = _ask(client, [{"role": "user", "content": QUESTION}], response_format={"type": "text"}, seed=-7,
                 temperature=0.8, frequency_penalty=0, presence_penalty=0, logit_bias={}, tools=[], tool_choice="none",
                 store=False, metadata={"a": "b"}, user="u", n=1)
    again = _ask(client, [{"role": "user", "content": QUESTION}], seed=-7, temperature=0.8)
    assert reply.choices[0].message.content == again.choices[0].message.content


REFUSALS = {"n": 2, "frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"5": 10},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
            "response_format": {"type": "json_object"}}


@pytest.mark.parametrize("field", sorted(REFUSALS))
def test_each_refused_field_gets_a_400_saying_why(client, field):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, [{"role": "user", "content": QUESTION}], **{field: REFUSALS[field]})
    body = err.value.body
    assert body["param"] == field and body["code"] == "unsupported_value" and REFUSED[field][1] in body["message"]


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "end"), ("best_of", 3)])
def test_completion_only_refusals(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="reference", prompt="Hi", max_tokens=2, **{field: value})
    assert err.value.body["param"] == field


def test_a_truncated_body_names_no_field(server):
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [{"role": "us',
                       headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] is None and "not valid JSON" in error["message"]


def test_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="logprobs: true"):
        _ask(client, [{"role": "user", "content": QUESTION}], top_logprobs=2)
