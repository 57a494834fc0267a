"""The engine: everything that runs a model over an evicting cache, top to bottom.

``step`` (``forward``, the only call into a model with a cache, and ``DecodeStep``, one token a row, compiled whole)
and ``graph_calls`` (a compiled step's graph called without dynamo once its guards chose it); ``prefill`` (a prompt a
chunk at a time) and ``sampling`` (a token from logits); ``generate`` (the loops behind ``sparsegen.generate``,
``compare`` and ``compress``) and ``speculative`` (lossless self-speculation from an evicted draft cache); ``context``
(a compressed context saved and loaded); and the continuous-batching ``scheduler`` behind ``chat`` and ``serve``, with
its ``session``\\s, ``memory`` admission and chat ``template``.
"""

from sparsegen.engine.scheduler import Engine
from sparsegen.engine.session import Job, Sampling, Session
from sparsegen.engine.template import ChatTemplate

__all__ = ["ChatTemplate", "Engine", "Job", "Sampling", "Session"]
