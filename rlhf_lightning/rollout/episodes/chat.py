"""Observations to token ids through the tokenizer's chat template (or raw text), token-exactly.

The harness appends, after each generated turn, exactly the text the template renders between
that assistant turn and the next generation prompt: the env's observation as the next user turn,
or tool results in the template's own tool-role format. That text is the difference between two
renders of a probe conversation, so it is right only for *prefix-stable* templates: ones that
render a conversation's earlier turns the same way once more turns follow.
:meth:`ChatFormatter.check_prefix_stable` tests that once, at start-up.
"""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import Message, Observation

# What the start-up probe conversation puts in an assistant turn: reasoning that templates which
# strip earlier reasoning (e.g. Qwen3's) drop once another turn follows.
PROBE_REASONING = "<think>probe reasoning</think>"
# The probe's reply, whose end locates what the template writes after an assistant turn: a
# string no template writes itself (a plain letter could be part of the closing text).
REPLY_SENTINEL = "\u27e6rlhf_lightning:end-of-reply\u27e7"
# The roles an observation's chat messages may take (``Message``: {"role": ..., "content": str}).
ROLES = ("system", "user", "assistant", "tool")


def observation_problem(observation: Any) -> str | None:
    """What is wrong with an env's observation (a string, or a list of chat messages, each a dict
    with a role of :data:`ROLES` and a string ``content``), or None. A bad message would otherwise
    fail inside the chat template's Jinja, with no env named."""
    if isinstance(observation, str):
        return None
    if not isinstance(observation, list):
        return f"observation of type {type(observation).__name__}; expected str or list of messages"
    for i, message in enumerate(observation):
        if not isinstance(message, dict):
            return f"message {i} of type {type(message).__name__}; expected a dict {{'role': ..., 'content': str}}"
        role = message.get("role")
        if role not in ROLES:
            return f"message {i} with role={role!r}; expected one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} ({role}) with content={message.get('content')!r}; expected a string"
    return None


class ChatFormatter:
    """Turns observations into token ids with the tokenizer's chat template (or raw text).

    Args:
        tokenizer: its ``apply_chat_template`` renders every turn.
        system_prompt: a system message put first when the observation has none.
        apply_chat_template: false for base models: raw text turns.
        tools: JSON schemas of the tools the model may call (``apply_chat_template(tools=...)``
            lists them, usually in the system turn); None: no tools.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.apply_chat_template = apply_chat_template
        self.tools = tools or None
        self._longest_token: int | None = None

    def fewest_tokens(self, observation: Observation) -> int:
        """A lower bound on the tokens ``observation``'s text takes, found without tokenizing it:
        its characters over twice the longest vocabulary entry's (a token decodes to at most as
        many characters as its vocabulary string has, byte-level and SentencePiece alike; the
        factor 2 leaves room for normalisers). A multi-megabyte observation is known not to fit
        in microseconds instead of seconds of tokenizing."""
        if self._longest_token is None:
            self._longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        chars = (
            len(observation)
            if isinstance(observation, str)
            else sum(len(m.get("content") or "") for m in observation)
        )
        return chars // (2 * self._longest_token)

    def messages(self, observation: Observation) -> list[Message]:
        msgs = (
            [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        )
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return cast(
            str,
            self.tokenizer.apply_chat_template(
                messages,
                tools=cast(Any, self.tools),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            ),
        )

    def prompt_text(self, observation: Observation) -> str:
        if not self.apply_chat_template:
            if not isinstance(observation, str):
                return "\n".join(m["content"] for m in observation)
            return observation if not self.system_prompt else f"{self.system_prompt}\n{observation}"
        return self.render(self.messages(observation), add_generation_prompt=True)

    def prompt_ids(self, observation: Observation) -> list[int]:
        return self.tokenizer(self.prompt_text(observation), add_special_tokens=False).input_ids

    def observation_text(self, observation: Observation) -> str:
        """The text between an assistant turn's end-of-turn token (already generated) and the
        next generation prompt: the env's observation as the next user turn (or its messages:
        tool results render in the template's tool-role format)."""
        if not self.apply_chat_template:
            text = (
                observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)
            )
            return f"\n{text}\n"
        probe: list[Message] = [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": REPLY_SENTINEL},
        ]
        new = (
            [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        )
        base = self.render(self.messages(probe))
        full = self.render(self.messages(probe + new), add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders earlier turns differently once a turn is added; multi-turn "
                "needs a prefix-stable template (see ChatFormatter.check_prefix_stable)"
            )
        tail = base[base.rindex(REPLY_SENTINEL) + len(REPLY_SENTINEL) :]  # closes it, e.g. "<|im_end|>\n"
        eos = str(self.tokenizer.eos_token or "")
        if eos and tail.startswith(eos):
            tail = tail[len(eos) :]  # the engine generated it already
        return tail + full[len(base) :]

    def observation_ids(self, observation: Observation) -> list[int]:
        return self.tokenizer(self.observation_text(observation), add_special_tokens=False).input_ids

    def check_prefix_stable(self, followups: list[list[Message]] | None = None) -> None:
        """Refuse (``ValueError`` naming the turn) a template that renders earlier turns
        differently once later ones follow: multi-turn trajectories would then differ from
        what the template renders for the whole conversation.

        The probe conversation is a user turn, an assistant turn with reasoning, then each of
        ``followups`` (default: another user turn; a tool env adds tool results) followed by an
        assistant turn, and a last user turn. Its text must be prefix-stable, and its token ids
        as the harness assembles them (the prompt's ids, each reply's ids and the end-of-sequence
        token, each observation's ids) must be the ids of the whole conversation rendered and
        tokenized at once (:meth:`check_token_exact`).
        """
        if not self.apply_chat_template:
            return
        rounds = followups or [[{"role": "user", "content": "second question"}]]
        conversation: list[Message] = [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": f"{PROBE_REASONING}first answer"},
        ]
        for k, messages in enumerate(rounds):
            conversation += [*messages, {"role": "assistant", "content": f"answer {k + 2}"}]
        conversation.append({"role": "user", "content": "last question"})
        convo = self.messages(conversation)
        previous = self.render(convo[:1])
        for n in range(2, len(convo) + 1):
            text = self.render(convo[:n])
            if not text.startswith(previous):
                changed = convo[n - 2]
                raise ValueError(
                    "the chat template is not prefix-stable: it renders the conversation's earlier turns "
                    f"differently once a {convo[n - 1]['role']!r} turn follows (turn {n - 1}, after a "
                    f"{changed['role']!r} turn{' with reasoning' if PROBE_REASONING in changed['content'] else ''}; "
                    "e.g. it strips earlier reasoning). Multi-turn trajectories need a template that "
                    "keeps earlier turns as they were: set model.chat_template to one that does, or "
                    "env.max_turns=1"
                )
            previous = text
        self.check_token_exact(rounds)

    def check_token_exact(self, rounds: list[list[Message]]) -> None:
        """Refuse (``ValueError`` with the first differing token) a template whose multi-turn
        trajectories, assembled turn by turn as the harness does, are not the token ids of the
        conversation rendered at once: e.g. a generation prompt unlike the template's own
        assistant header, or text that tokenizes differently in pieces than whole."""
        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        replies = [f"{PROBE_REASONING}first answer", *(f"answer {k + 2}" for k in range(len(rounds)))]
        observations = [*rounds, [{"role": "user", "content": "last question"}]]
        conversation: list[Message] = [{"role": "user", "content": "first question"}]
        ids = self.prompt_ids(conversation[0]["content"])
        for reply, observation in zip(replies, observations, strict=True):
            ids += tok(reply, add_special_tokens=False).input_ids + eos
            ids += self.observation_ids(observation)
            conversation += [{"role": "assistant", "content": reply}, *observation]
        whole = tok(
            self.render(self.messages(conversation), add_generation_prompt=True), add_special_tokens=False
        )
        rendered = list(whole.input_ids)
        if ids == rendered:
            return
        i = next((k for k, (a, b) in enumerate(zip(ids, rendered)) if a != b), min(len(ids), len(rendered)))
        raise ValueError(
            "the chat template's multi-turn conversation is not token-exact: assembled turn by turn as "
            f"the harness does it (prompt, reply + eos, observation, ...), it differs from the whole "
            f"conversation rendered at once from token {i}: {tok.decode(ids[i : i + 12])!r} against "
            f"{tok.decode(rendered[i : i + 12])!r}. Set model.chat_template to one whose generation prompt "
            "and turns tokenize the same in pieces, or env.max_turns=1"
        )


def latest_view(instructions: Observation, observation: Observation) -> Observation:
    """The prompt of a turn with ``env.history=last``: the instructions, then the latest
    observation. Two strings make one user message: joined with a blank line, or directly when
    the instructions end with a newline already (GEM's do); chat messages are put one after the
    other (a string as a user message).

    ``instructions``: the env's reset info ``instructions`` when it gives one (GEM: its rules
    without the first board), else the first observation."""
    if isinstance(instructions, str) and isinstance(observation, str):
        return instructions + ("" if instructions.endswith("\n") else "\n\n") + observation
    as_messages = lambda o: [{"role": "user", "content": o}] if isinstance(o, str) else list(o)  # noqa: E731
    return [*as_messages(instructions), *as_messages(observation)]


def env_tools(factory: Any) -> list[dict[str, Any]] | None:
    """The JSON schemas of the tools an env offers (``tool_schemas()``), for the chat template."""
    schemas = getattr(factory(), "tool_schemas", None)
    return list(schemas()) if callable(schemas) else None


def check_template(formatter: ChatFormatter, multi_turn: bool, history: str = "full") -> None:
    """At start-up: an env's tools must reach the prompt (a template that ignores ``tools=``
    would train a model on tools it is never shown), multi-turn needs a prefix-stable
    template, and a tool env keeps the call before each tool result (``env.history`` is not
    ``last``)."""
    if formatter.tools and multi_turn and history == "last":
        raise ConfigError(
            "env.history",
            history,
            "full or last_k with a tool env: a tool result answers the call in the reply before it, "
            "which history=last leaves out",
        )
    if formatter.tools and formatter.apply_chat_template:
        text = formatter.render(formatter.messages("Q"), add_generation_prompt=True)
        missing = [t["function"]["name"] for t in formatter.tools if t["function"]["name"] not in text]
        if missing:
            raise ConfigError(
                "model.chat_template",
                "<the tokenizer's>",
                f"a template that renders tools= (the prompt lacks {', '.join(missing)}); "
                "e.g. model.chat_template=${asset:chat_templates/tools.jinja}",
            )
    if not multi_turn:
        return
    followups = [[{"role": "user", "content": "second question"}]]
    if formatter.tools:
        followups.append([{"role": "tool", "content": "tool result"}])
    try:
        formatter.check_prefix_stable(followups)
    except Exception as err:  # the template's own errors (e.g. no tool role) say what it cannot render
        raise ConfigError(
            "model.chat_template", "<the tokenizer's>", f"{type(err).__name__}: {err}"
        ) from None
