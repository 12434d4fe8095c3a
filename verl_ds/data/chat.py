"""Conversations as token ids, token-in/token-out: `ChatCodec` turns prompts, and the observations
of a multi-turn episode, into ids without ever re-rendering earlier turns from text.

An observation (tool result, user message) becomes the ids the chat template adds after an
assistant turn: rendered after a fixed synthetic conversation, minus that conversation's ids (the
prefix equality is checked), plus the separator the template writes after the end-of-turn token,
which the model never generates (ChatML's `\\n` after `<|im_end|>`). Without a chat template an
observation's text is tokenized as it is and appended.
"""

from __future__ import annotations

from verl_ds.errors import ConfigError

# tools described in the system prompt when the chat template has no tools section (SmolLM2's)
TOOLS_SYSTEM_PROMPT = (
    'You can call tools. To call one, write <tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call> '
    "and stop; its result comes back in a tool message. Answer without a tool call when you are done.\n"
    "Tools:\n{tools}"
)


class ChatCodec:
    """Prompt and observation ids for one tokenizer. `use_template`: data.apply_chat_template.
    `tools`: JSON schemas, given to the template (`tools=`) or, when it has no tools section,
    described in a system message. `few_shot`: chat messages before every prompt. `model`: named
    in errors."""

    def __init__(
        self,
        tokenizer,
        use_template: bool,
        tools: list[dict] | None = None,
        system_prompt: str | None = None,
        model: str = "the model",
        eos_ids: list[int] | None = None,
        few_shot: list[dict] | None = None,
    ):
        import json

        self.tok, self.use_template, self.model = tokenizer, use_template, model
        self.tools, self.system, self.few_shot = tools or None, system_prompt, list(few_shot or [])
        self.eos_ids = set(eos_ids or [tokenizer.eos_token_id])
        self._separator: list[int] = []
        if not use_template:
            return
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("data.apply_chat_template", f"{model}'s tokenizer has no chat template")
        if self.tools and self._render_text([{"role": "user", "content": "x"}]) == self._render_text(
            [{"role": "user", "content": "x"}], tools=None
        ):
            desc = "\n".join(json.dumps(t) for t in self.tools)  # the template ignores tools=
            self.system = (self.system + "\n\n" if self.system else "") + TOOLS_SYSTEM_PROMPT.format(tools=desc)
            self.tools = None
        self._dummy = self.prompt_messages("x") + [{"role": "assistant", "content": "y"}]
        self._prefix = None

    def check_turns(self) -> None:
        """Multi-turn needs a template whose assistant turn ends with eos and that preserves prefixes:
        checked once at start (a ConfigError naming the model), before any episode runs."""
        if not self.use_template or self._prefix is not None:
            return
        prefix = self.render_ids(self._dummy)
        ends = [i for i, t in enumerate(prefix) if t in self.eos_ids]
        if not ends:
            raise ConfigError(
                "data.apply_chat_template",
                f"{self.model}'s chat template does not end an "
                "assistant turn with the eos token: turns cannot be joined as ids",
            )
        self._prefix, self._separator = prefix, prefix[ends[-1] + 1 :]
        self.observation_ids([{"role": "user", "content": "z"}])

    # ------------------------------------------------------------------ rendering
    def _render_text(self, messages: list[dict], add_generation_prompt: bool = False, tools="default") -> str:
        return self.tok.apply_chat_template(
            messages,
            tools=self.tools if tools == "default" else tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def render_text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._render_text(messages, add_generation_prompt)

    def render_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """One-shot ids of a conversation (a template holds its own special tokens)."""
        text = self.render_text(messages, add_generation_prompt)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_messages(self, prompt: str) -> list[dict]:
        """[system] + few-shot messages (a demonstration, e.g. of a tool call) + the user's prompt."""
        return (
            ([{"role": "system", "content": self.system}] if self.system else [])
            + [dict(m) for m in self.few_shot]
            + [{"role": "user", "content": prompt}]
        )

    def prompt_texts(self, prompts: list[str]) -> list[str]:
        """What the tokenizer reads for each prompt: the rendered conversation, or the text itself."""
        if not self.use_template:
            return list(prompts)
        return [self.render_text(self.prompt_messages(p), add_generation_prompt=True) for p in prompts]

    # ------------------------------------------------------------------ episodes
    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The ids that follow a finished assistant turn (ending in eos) for `messages`, up to the next
        assistant generation prompt."""
        if not self.use_template:
            return list(self.tok("".join(m["content"] for m in messages), add_special_tokens=False)["input_ids"])
        self.check_turns()
        full = self.render_ids(self._dummy + messages, add_generation_prompt=True)
        if full[: len(self._prefix)] != self._prefix:
            raise ConfigError(
                "data.apply_chat_template",
                f"{self.model}'s chat template does not preserve prefixes: a later message changes earlier ids",
            )
        return self._separator + full[len(self._prefix) :]

    def content_ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def action_text(self, ids: list[int]) -> str:
        """An assistant turn's content: its ids without the closing eos."""
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def extends(self, before: list[dict], after: list[dict]) -> bool:
        """Whether the template renders `after` (ending in a generation prompt) as a continuation of
        `before`: false for a template that rewrites history (e.g. strips earlier reasoning)."""
        if not self.use_template:
            return True
        return self.render_text(after, add_generation_prompt=True).startswith(self.render_text(before))

    def matches_one_shot(self, prompt_ids: list[int], messages: list[dict], response_ids: list[int]) -> bool:
        """Strict tokenization check of a finished episode segment: its ids equal the one-shot
        rendering of its messages (the template's; without one, the tokenizer over the whole text),
        up to the separator after the last end-of-turn, which the model never generates."""
        ours = list(prompt_ids) + list(response_ids)
        ref = self.render_ids(messages) if self.use_template else self.content_ids(self.decode(ours))
        return ref[: len(ours)] == ours and (len(ref) == len(ours) or ref[len(ours) :] == self._separator)
