"""Serving conversations from bounded caches: the engine, a terminal chat, and an OpenAI-compatible HTTP server."""

from sparsegen.serve.engine import Engine, Job, Sampling, Session
from sparsegen.serve.template import ChatTemplate

__all__ = ["ChatTemplate", "Engine", "Job", "Sampling", "Session"]
