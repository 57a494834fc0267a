"""``/inspect``: what each policy keeps of a text, computed off the worker thread, cancelled when its client leaves."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from sparsegen.engine.scheduler import Engine
from sparsegen.serve.schemas import ApiError, ClientGone, InspectRequest, Limits, shutting_down


class InspectionCancelled(Exception):
    """Raised inside an inspection between two chunks: its client left, or the server is stopping."""


class Inspector:
    """The cache inspector's work: one inspection at a time, beside the engine (it runs the model over a whole text
    once per policy), with its own tokenizer (a fast tokenizer refuses concurrent calls). At most
    ``max_inspections`` are running or waiting (429 beyond); each is sized before it waits (by its text's length,
    then its tokens, counted off the event loop), and stops at its next chunk when its client leaves or the server
    stops."""

    def __init__(self, engine: Engine, limits: Limits, model_name: str):
        self.engine, self.limits, self.model_name = engine, limits, model_name
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sparsegen-inspect")
        self.tokenizer = None  # copied at the first inspection
        self.taken = 0  # inspections running or waiting (changed on the event loop only)
        self.stops: set[threading.Event] = set()  # one per inspection taken
        self.closed = False

    async def inspect(self, body: InspectRequest, request: Request) -> JSONResponse:
        from sparsegen.eval.inspect import inspect

        limits = self.limits
        if self.closed:
            raise shutting_down()
        if body.max_new_tokens > limits.max_tokens:
            raise ApiError(400, f"max_new_tokens is over this server's limit of {limits.max_tokens}",
                           param="max_new_tokens")
        if self.taken >= limits.max_inspections:
            raise ApiError(429, f"{limits.max_inspections} inspections are already running or waiting "
                                "(--max-inspections); retry later", "rate_limit_error", "overloaded")
        stop = threading.Event()
        self.taken += 1
        self.stops.add(stop)
        try:
            try:
                await asyncio.to_thread(self.engine.tokenize, body.text + (body.question or ""), True, True)
            except ValueError as err:
                raise ApiError(400, f"{err} (--max-prompt-tokens)", param="text") from None

            if self.tokenizer is None:
                self.tokenizer = copy.deepcopy(self.engine.tokenizer)

            def interrupt() -> None:
                if stop.is_set():
                    raise InspectionCancelled

            run = partial(inspect, self.engine.model, self.tokenizer, body.text, body.policies, body.budget,
                          question=body.question, answer=body.answer, protocol=body.protocol,
                          kv_bits=body.kv_bits, chunk_size=self.engine.chunk_size,
                          max_new_tokens=body.max_new_tokens, model_name=self.model_name, after_chunk=interrupt)
            work = asyncio.get_running_loop().run_in_executor(self.pool, run)
            while True:
                done, _ = await asyncio.wait([work], timeout=0.25)
                if done:
                    break
                if self.closed or await request.is_disconnected():
                    stop.set()  # a running inspection stops at its next chunk; a waiting one never starts
                    work.cancel()
                    if self.closed:
                        raise shutting_down()
                    raise ClientGone
            try:
                return JSONResponse(work.result())
            except ValueError as err:
                raise ApiError(400, str(err)) from None
            except InspectionCancelled:
                raise shutting_down() from None
        finally:
            self.taken -= 1
            self.stops.discard(stop)

    def stop_all(self) -> None:
        """Stop every inspection (each at its next chunk) and take no more. Safe in a signal handler."""
        self.closed = True
        for stop in list(self.stops):
            stop.set()

    def close(self) -> None:
        self.stop_all()
        self.pool.shutdown(wait=False, cancel_futures=True)


def route_inspection(app: FastAPI, inspector: Inspector) -> None:
    @app.get("/inspect", response_class=HTMLResponse)
    async def inspect_page():
        """The cache inspector: a form that asks ``/v1/inspect`` (which takes the API key, if the server has one)."""
        from sparsegen.eval.inspect import page

        return HTMLResponse(page(api=True))

    @app.post("/v1/inspect")
    async def inspect_kept(body: InspectRequest, request: Request):
        return await inspector.inspect(body, request)
