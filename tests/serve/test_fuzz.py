"""Property-based fuzzing of the live server: bodies drawn from its own OpenAPI request schemas (valid and not), and
arbitrary JSON. Whatever arrives, the answer is never a 5xx, and every 4xx is an OpenAI-shaped error."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparsegen.serve.schemas import REFUSED, ChatCompletion, Completion, ErrorReply, Limits
from tests.serve.test_server import Running

hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")

EXAMPLES = 120  # per endpoint: about 20 s in all with the reference model

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fuzzed(reference_model):
    running = Running(*reference_model, Limits(max_sessions=4, max_batch=4, max_tokens=4, max_messages=4,
                                               max_request_bytes=8192, max_prompt_tokens=256))
    yield running
    running.stop()
    assert running.app.state.worker.is_alive() is False


@pytest.fixture(scope="module")
def reference_model():
    import sparsegen

    return sparsegen.load("reference")


def _schema(url: str, name: str) -> dict:
    document = httpx.get(f"{url}/openapi.json").json()
    return {"$ref": f"#/components/schemas/{name}", "components": document["components"]}


def _check(response: httpx.Response, reply=None) -> None:
    """No 5xx; every 4xx the OpenAI error shape; a JSON 200 the documented reply model."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = ErrorReply.model_validate_json(response.text).error
        assert error.message and error.type
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif reply is not None and response.headers["content-type"].startswith("application/json"):
        reply.model_validate_json(response.text)


@pytest.mark.parametrize("path, name, reply", [("/v1/chat/completions", "ChatRequest", ChatCompletion),
                                               ("/v1/completions", "CompletionRequest", Completion)])
@pytest.mark.heavy
def test_no_body_gets_a_5xx_and_every_4xx_is_openai_shaped(fuzzed, path, name, reply):
    schema = _schema(fuzzed.url, name)
    drawn = hypothesis_jsonschema.from_schema(schema)
    # the schema admits fields whose values the server refuses (REFUSED: n > 1, penalties, tools...), which nearly
    # every drawn body sets: the same bodies without them are drawn too, so that served requests are fuzzed as well
    bodies = st.one_of(drawn, drawn.map(lambda body: {k: v for k, v in body.items() if k not in REFUSED}), json_values,
                       st.dictionaries(st.sampled_from(sorted(schema["components"]["schemas"][name]["properties"])),
                                       json_values, max_size=5))

    seen = set()

    served = {"max_tokens": 4, **({"messages": [{"role": "user", "content": "Hi"}]} if name == "ChatRequest"
                                   else {"prompt": "Hi"})}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @example(body=served, stream=True, raw=b"")  # a served body is always among them, whatever the draw
    @given(body=bodies, stream=st.booleans(), raw=st.binary(max_size=64))
    def probe(body, stream, raw):
        if isinstance(body, dict) and "stream" in body:
            body["stream"] = stream
        with httpx.Client(base_url=fuzzed.url, timeout=60) as client:
            with client.stream("POST", path, content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"}) as response:
                response.read()
                _check(response, reply)
                seen.add(response.status_code)
                if response.status_code == 200 and body.get("stream"):
                    assert response.text.rstrip().endswith("data: [DONE]")
            _check(client.post(path, content=raw, headers={"content-type": "application/json"}))

    probe()
    assert 200 in seen and 400 in seen, seen  # both served and refused requests were drawn
    assert httpx.get(f"{fuzzed.url}/health").json() == {"status": "ok"}
