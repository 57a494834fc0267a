"""Turning chat messages into the text a model continues: its own chat template, or a plain one for base models."""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


class ChatTemplate:
    """``render(messages)`` gives the conversation up to the assistant's next turn.

    Models with a chat template use it (``add_generation_prompt``); base models such as the reference model get
    ``User: ...`` / ``Assistant: ...`` lines, and their replies end where they start the next ``User:`` line.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.native = bool(getattr(tokenizer, "chat_template", None))
        self.stop = [] if self.native else ["\nUser:", "\nSystem:"]

    def render(self, messages: list[dict]) -> str:
        for message in messages:
            if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f"each message needs a role ({', '.join(ROLES)}) and a string content")
        if self.native:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lines = []
        for message in messages:
            content = message["content"]
            lines.append(f"{message['role'].capitalize()}:{content if content[:1].isspace() else ' ' + content}\n")
        return "".join(lines) + "Assistant:"

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the rendered text still needs the tokenizer's BOS (a native template writes its own)."""
        return not self.native
