"""``serve --ray``: two replicas of the reference model on a local Ray cluster behind Ray Serve's proxy. Each session
stays on its replica; a replica killed between turns loses no reply, and its sessions continue from their
snapshots with the text an undisturbed run gives; bad input gets what one process answers."""

import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from sparsegen.cli import build_parser  # noqa: E402
from sparsegen.cli.serve import server_app  # noqa: E402
from sparsegen.serve.replicas import REPLICA_HEADER, deployment  # noqa: E402

TURNS = ["Tell me about the old house by the river.", "And the garden behind it?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    port = _free_port()
    store = tmp_path_factory.mktemp("sessions")
    args = build_parser().parse_args(["serve", "--model", "reference", "--policy", "h2o", "--budget", "24",
                                      "--chunk-size", "16", "--max-new-tokens", "8", "--port", str(port),
                                      "--session-store", str(store)])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(server_app, args, True, replicas=2), name="sparsegen", route_prefix="/")
        yield f"http://127.0.0.1:{port}", store
    finally:
        serve.shutdown()
        ray.shutdown()


def _turn(url: str, session: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8},
                      headers={"X-Session-Id": session}, timeout=120)


def _conversation(url: str, session: str, topic: int, before_second=lambda replica: None) -> list[httpx.Response]:
    messages = [{"role": "user", "content": f"{TURNS[0]} It is number {topic}."}]
    first = _turn(url, session, messages)
    before_second(first.headers[REPLICA_HEADER])
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
    return [first, _turn(url, session, messages)]


def test_each_session_stays_on_its_replica_and_new_sessions_spread(replicas):
    url, _ = replicas
    runs = {f"stay{i}": _conversation(url, f"stay{i}", i) for i in range(6)}
    for first, second in runs.values():
        assert first.status_code == second.status_code == 200
        assert first.headers[REPLICA_HEADER] == second.headers[REPLICA_HEADER]  # sticky
        assert second.headers["X-Session-History"] == "kept"
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"]
    assert len({first.headers[REPLICA_HEADER] for first, _ in runs.values()}) == 2  # both replicas took sessions


def test_a_replica_killed_between_turns_fails_nothing_and_its_sessions_continue_from_their_snapshots(replicas):
    url, store = replicas
    expected = [_conversation(url, f"calm{i}", i)[1].json()["choices"][0]["message"]["content"] for i in range(4)]
    killed, written, before = [], [0], len(list(store.glob("*.safetensors")))

    def kill_the_first_replica(replica: str) -> None:
        written[0] += 1  # (each first turn's snapshot is written just after its reply: wait for it, as a client would)
        deadline = time.monotonic() + 30
        while len(list(store.glob("*.safetensors"))) < before + written[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if not killed:
            ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=False)
            killed.append(replica)

    runs = [_conversation(url, f"moved{i}", i, kill_the_first_replica) for i in range(4)]
    assert all(r.status_code == 200 for run in runs for r in run)  # 8/8: no reply fails
    moved = [(i, run) for i, run in enumerate(runs) if run[0].headers[REPLICA_HEADER] == killed[0]]
    assert moved  # (the first session's replica)
    for i, (_, second) in moved:
        assert second.headers[REPLICA_HEADER] != killed[0]
        assert second.headers["X-Session-History"] == "kept"  # restored, not re-encoded
        assert second.json()["choices"][0]["message"]["content"] == expected[i]
    assert list(store.glob("*.safetensors"))


def test_bad_input_gets_what_one_process_answers(replicas):
    url, _ = replicas
    empty = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    unknown = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 10**6}, timeout=60)
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health", timeout=60).json()["status"] == "ok"
