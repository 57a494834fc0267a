"""A stand-in tokenizer for engine tests on tiny random models: text is space-separated token ids."""


class IdTokenizer:
    eos_token_id, chat_template = None, None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)
