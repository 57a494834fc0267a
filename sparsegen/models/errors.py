"""Errors of the model layer."""


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""
