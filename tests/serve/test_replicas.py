"""``serve --ray``: two replicas of the reference model on a local Ray cluster behind Ray Serve's proxy (the
scale-down test last: it leaves one replica). Each session stays on its replica; a replica killed between turns
loses no reply, and its sessions continue from their snapshots with the text an undisturbed run gives; bad input
gets what one process answers."""

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

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


def _flags(store) -> list[str]:
    return ["--model", "reference", "--policy", "h2o", "--budget", "24", "--chunk-size", "16", "--max-new-tokens", "8",
            "--session-store", str(store)]


def replicas_args(url: str, store) -> tuple:
    """The deployment's arguments as the fixture gave them (to deploy it again at another scale)."""
    return (build_parser().parse_args(["serve", *_flags(store), "--port", url.rsplit(":", 1)[1]]),)


@contextmanager
def deployed(flags: list[str], replicas: int = 2):
    """``sparsegen serve FLAGS --ray --replicas N`` on a local Ray cluster: its URL (other test modules run their
    server tests against it too)."""
    port = _free_port()
    args = build_parser().parse_args(["serve", *flags, "--port", str(port)])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(server_app, args, True, replicas=replicas), name="sparsegen", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    store = tmp_path_factory.mktemp("sessions")
    with deployed(_flags(store)) as url:
        yield url, store


def _running(replicas: int = 2) -> None:
    """Wait until ``replicas`` are up (Ray Serve replaces a killed one in the background)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = serve.status().applications["sparsegen"].deployments["sparsegen"].replica_states
        if states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Ray Serve did not bring {replicas} replicas up: {states}")


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


def test_a_replica_killed_between_turns_under_load_fails_nothing_and_its_sessions_continue_from_their_snapshots(
        replicas):
    """8 sessions, 4 at a time: every first turn, one replica killed, every second turn."""
    url, store = replicas
    _running()
    sessions = range(8)
    expected = [_conversation(url, f"calm{i}", i)[1].json()["choices"][0]["message"]["content"] for i in sessions]
    talks = [[{"role": "user", "content": f"{TURNS[0]} It is number {i}."}] for i in sessions]
    before = len(list(store.glob("*.safetensors")))
    with ThreadPoolExecutor(4) as pool:
        firsts = list(pool.map(lambda i: _turn(url, f"moved{i}", talks[i]), sessions))
        deadline = time.monotonic() + 30  # (each first turn's snapshot is written just after its reply)
        while len(list(store.glob("*.safetensors"))) < before + len(firsts) and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = firsts[0].headers[REPLICA_HEADER]
        ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=False)
        for talk, first in zip(talks, firsts):
            talk += [first.json()["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
        seconds = list(pool.map(lambda i: _turn(url, f"moved{i}", talks[i]), sessions))
    assert all(r.status_code == 200 for r in firsts + seconds)  # 16/16: no reply fails
    moved = [i for i in sessions if firsts[i].headers[REPLICA_HEADER] == killed]
    assert 0 < len(moved) < len(sessions)  # (new sessions spread over both replicas)
    for i in sessions:
        second = seconds[i]
        assert second.headers["X-Session-History"] == "kept"  # kept where it was, or restored: never re-encoded
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert second.json()["choices"][0]["message"]["content"] == expected[i]
        if i in moved:
            assert second.headers[REPLICA_HEADER] != killed


def test_bad_input_gets_what_one_process_answers(replicas):
    url, _ = replicas
    empty = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    unknown = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 10**6}, timeout=60)
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health", timeout=60).json()["status"] == "ok"


def test_a_replica_killed_during_a_reply_fails_that_reply_cleanly_and_the_retry_succeeds(replicas):
    url, _ = replicas
    _running()
    messages = [{"role": "user", "content": TURNS[0]}]
    first = _turn(url, "dying", messages)
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=120,
                            json={"messages": messages, "max_tokens": 1000, "ignore_eos": True},
                            headers={"X-Session-Id": "dying"})
        time.sleep(1.0)  # (a 1,000-token reply is decoding)
        ray.kill(ray.get_actor(first.headers[REPLICA_HEADER], namespace="serve"), no_restart=False)
        failed = reply.result()
    # Ray Serve's proxy answers for the replica that is gone: a plain 500 (not OpenAI's JSON, which only the replica
    # could have written); the official client retries 5xx itself, and the retry lands on the live replica
    assert failed.status_code >= 500
    retry = _turn(url, "dying", messages)
    assert retry.status_code == 200 and retry.headers[REPLICA_HEADER] != first.headers[REPLICA_HEADER]


def test_a_ray_serve_config_file_names_the_same_application():
    from ray.serve import Application

    from sparsegen.cli.serve import ray_app

    assert isinstance(ray_app({"flags": "--model reference --policy h2o --budget 24 --replicas 2"}), Application)
    with pytest.raises(ValueError, match="flags as one string"):
        ray_app({"model": "reference"})
    with pytest.raises(ValueError, match="--max-new-tokens 5000 is over --max-tokens-limit"):
        ray_app({"flags": "--model reference --max-new-tokens 5000"})


def test_replicas_without_ray_is_refused(capsys):
    from sparsegen.cli import main

    assert main(["serve", "--model", "reference", "--replicas", "2"]) != 0
    assert "give --ray" in capsys.readouterr().err


def test_metrics_show_each_replica_and_their_sum(replicas):
    url, _ = replicas
    _running()
    assert _turn(url, "counted", [{"role": "user", "content": TURNS[0]}]).status_code == 200
    time.sleep(1.5)  # (every replica has posted its numbers)
    text = httpx.get(f"{url}/metrics", timeout=60).text
    requests = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("sparsegen_requests_total{")}
    assert len(requests) >= 3 and "all" in requests  # both replicas (and one just killed, for 5 s), and their sum
    assert requests["all"] == sum(v for name, v in requests.items() if name != "all") > 0


def test_a_drained_replica_hands_its_sessions_over_through_their_snapshots(replicas):
    """Scaling down to one replica: Ray Serve drains the other (replies in flight finish) or redeploys, and the
    sessions of a replica gone continue from their snapshots on the one left, with the text an undisturbed run
    gives."""
    url, store = replicas
    _running()
    firsts, talks = {}, {}
    while len({r.headers[REPLICA_HEADER] for r in firsts.values()}) < 2 and len(firsts) < 60:  # (the router puts new
        i = len(firsts)  # sessions where fewest are: a replica restarted by an earlier test takes them all at first)
        talks[i] = [{"role": "user", "content": f"{TURNS[0]} It is number {10 + i}."}]
        firsts[i] = _turn(url, f"drain{i}", talks[i])
    homes = {first.headers[REPLICA_HEADER]: i for i, first in firsts.items()}  # the last session on each replica
    assert len(homes) == 2
    time.sleep(0.5)  # (the snapshots of the turns just answered are written)
    serve.run(deployment(server_app, *replicas_args(url, store), True, replicas=1), name="sparsegen",
              route_prefix="/")
    seconds = {}
    for i in homes.values():
        talks[i] += [firsts[i].json()["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
        seconds[i] = _turn(url, f"drain{i}", talks[i])
    survivor = {r.headers[REPLICA_HEADER] for r in seconds.values()}
    assert len(survivor) == 1  # (a replica of before, or a new one: Ray Serve may redeploy rather than scale down)
    for i, second in seconds.items():
        expected = _conversation(url, f"still{i}", 10 + i)[1].json()["choices"][0]["message"]["content"]
        assert second.status_code == 200 and second.headers["X-Session-History"] == "kept"
        assert second.json()["choices"][0]["message"]["content"] == expected
