"""Serving over HTTP and in a terminal: the OpenAI-compatible server (``server``, its connections in ``protocol``) and
``chat``, both front ends of ``sparsegen.engine``'s scheduler."""
