"""Serving past one process on Ray Serve: each replica is one sparsegen engine behind the same app (routes, errors,
limits, auth, ``/health``, ``/metrics``), Ray Serve's HTTP proxy in front, and every turn of a session routed to
the replica that holds its cache.

Ray Serve's proxy reads a session's id from the ``X-Session-Id`` header (its ``RAY_SERVE_SESSION_ID_HEADER_KEY``,
which is sparsegen's own header) into the request's metadata; ``SessionAffinityRouter`` sends a known session to
its replica and a new one to the replica with the fewest requests in flight and sessions, so Ray's own autoscaling
and health checks stay in charge of the replicas. A session whose replica is gone (killed, drained, scaled down)
continues on another: from its snapshot in ``--session-store`` where one was written after its last turn
(``engine.sessions.SessionStore``), else re-encoded from the messages the client sends, as an evicted session is.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from sparsegen.serve.server import prometheus

REPLICA_HEADER = "X-Sparsegen-Replica"  # on every reply: the replica (its Ray actor's name) that answered
HOMES = 1 << 20  # sessions whose replica a router remembers (least recently routed forgotten first)
PUSH_SECONDS = 1.0  # how often a replica posts its numbers to the board
FRESH_SECONDS = 5.0  # a replica silent for longer is gone from /metrics


class SessionAffinityRouter(RequestRouter):
    """A session's turns go to the replica that served its last one; a request without a session, or a session new
    to this router or whose replica is gone, to the least loaded replica (requests in flight, then sessions held),
    with the others behind it as Ray Serve's fallback when that one refuses (it is at ``max_ongoing_requests``)."""

    def initialize_state(self, **kwargs) -> None:
        self.homes: OrderedDict[str, ReplicaID] = OrderedDict()  # session id -> its replica
        self.held: dict[ReplicaID, int] = {}  # replica -> sessions homed there

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        home = self.homes.get(session) if session else None
        ranked = sorted(candidate_replicas, key=self._load)
        at_home = [r for r in ranked if r.replica_id == home]
        return [[r] for r in at_home + [r for r in ranked if r.replica_id != home]]

    def _load(self, replica: RunningReplica) -> tuple[int, int]:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return (queued or 0, self.held.get(replica.replica_id, 0))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        session = pending_request.metadata.session_id
        if not session:
            return
        previous = self.homes.pop(session, None)
        if previous is not None:
            self.held[previous] = self.held.get(previous, 1) - 1
        self.homes[session] = replica_id
        self.held[replica_id] = self.held.get(replica_id, 0) + 1
        while len(self.homes) > HOMES:
            _, forgotten = self.homes.popitem(last=False)
            self.held[forgotten] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for replica_id in [r for r in self.held if r not in alive]:
            self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        """Its sessions have no home now: their next turns go where the load is lowest."""
        for session in [s for s, home in self.homes.items() if home == replica_id]:
            del self.homes[session]
        self.held.pop(replica_id, None)


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Every replica's latest ``/metrics`` numbers, posted by each every ``PUSH_SECONDS``: what any replica's
    ``/metrics`` shows of the others."""

    def __init__(self):
        self.latest: dict[str, tuple[dict, float]] = {}

    def put(self, replica: str, values: dict) -> None:
        self.latest[replica] = (values, time.monotonic())

    def get(self) -> dict[str, dict]:
        now = time.monotonic()
        return {name: values for name, (values, at) in self.latest.items() if now - at < FRESH_SECONDS}


def cluster_metrics(own: str, measured: dict, others: dict[str, dict]) -> dict[str, dict]:
    """``/metrics`` under Ray: each live replica's numbers (``replica="NAME"``, this one's measured now) and their
    sum (``replica="all"``)."""
    series = {**others, own: measured}
    total = {}
    for values in series.values():
        for name, value in values.items():
            total[name] = total.get(name, 0) + value
    return {**series, "all": total}


@serve.ingress()
class Replica:
    """One sparsegen engine and its app, built on the replica by ``build`` (a module-level function, so that Ray
    ships a reference to it, not a model)."""

    def __init__(self, build: Callable[..., FastAPI], *args):
        self.sparsegen_app = app = build(*args)
        context = serve.get_replica_context()
        name = context.replica_id.to_full_id_str()  # (its Ray actor's name)
        board = MetricsBoard.options(name=f"sparsegen-metrics-{context.app_name}", namespace="serve",
                                     get_if_exists=True, lifetime="detached").remote()
        measured = app.state.measured
        app.state.show_metrics = lambda: prometheus(cluster_metrics(name, measured(),
                                                                    ray.get(board.get.remote(), timeout=5)))

        def post() -> None:
            while True:
                board.put.remote(name, measured())
                time.sleep(PUSH_SECONDS)

        threading.Thread(target=post, name="sparsegen-metrics", daemon=True).start()

        @app.middleware("http")
        async def say_which(request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = name
            return response

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.sparsegen_app

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        died = self.sparsegen_app.state.worker.died
        if died is not None:
            raise RuntimeError(f"the engine thread died: {died}")


def deployment(build: Callable[..., FastAPI], *args, replicas: int = 1, max_ongoing_requests: int = 256,
               name: str = "sparsegen"):
    """The application Ray Serve runs: ``replicas`` copies of ``Replica(build, *args)`` behind
    ``SessionAffinityRouter``. ``max_ongoing_requests``: what one replica takes before the router tries another; set
    it above the replica's own queue (``--max-batch`` + ``--max-queue``) so that its 429 and its sessions' affinity
    decide, not Ray's backpressure."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    router = RequestRouterConfig(request_router_class=f"{__name__}:SessionAffinityRouter")
    return serve.deployment(Replica, name=name, num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
                            request_router_config=router, health_check_period_s=2,
                            ray_actor_options={"num_cpus": 0}).bind(build, *args)
