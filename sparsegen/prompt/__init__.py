"""Prompt recovery (Compress, Then Prompt): a soft prompt learned on a frozen compressed model, or a fixed text."""

from sparsegen.prompt.prefix import PromptPrefix, attach, detach, prefix_of
from sparsegen.prompt.tune import TuneConfig, tune_prompt

__all__ = ["PromptPrefix", "TuneConfig", "attach", "detach", "prefix_of", "tune_prompt"]
