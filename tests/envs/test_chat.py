"""Chat templates: tools reach the template, and templates that rewrite earlier turns are refused."""

from __future__ import annotations

import pytest

from rlhf_lightning.rollout.episodes.chat import ChatFormatter

# Like Qwen3's: earlier assistant turns lose their reasoning once another turn follows.
STRIPPING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_the_embedded_templates_are_prefix_stable(tiny_tokenizer):
    ChatFormatter(tiny_tokenizer).check_prefix_stable()
    ChatFormatter(tiny_tokenizer, system_prompt="Be brief.").check_prefix_stable()


def test_a_template_that_strips_earlier_reasoning_is_refused(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(tiny_tokenizer, "chat_template", STRIPPING)
    with pytest.raises(ValueError, match=r"not prefix-stable.*after a 'assistant' turn with reasoning"):
        ChatFormatter(tiny_tokenizer).check_prefix_stable()


def test_a_multi_turn_run_with_such_a_template_stops_at_start_up(fast_cfg, tmp_path):
    from rlhf_lightning.config.errors import ConfigError
    from rlhf_lightning.run import build

    cfg = fast_cfg("env=guess_number", f"model.chat_template={STRIPPING!r}".replace("\n", "\\n"))
    with pytest.raises(ConfigError, match=r"model.chat_template=.*not prefix-stable"):
        build(cfg, tmp_path)


def test_tools_reach_the_template(tiny_tokenizer, monkeypatch):
    template = (
        "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function.name') | join(',')) + '<|im_end|>\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    monkeypatch.setattr(tiny_tokenizer, "chat_template", template)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = ChatFormatter(tiny_tokenizer, tools=tools).prompt_text("Q")
    assert text.startswith("<|im_start|>system\nTools: add<|im_end|>\n<|im_start|>user\nQ")
    assert "Tools" not in ChatFormatter(tiny_tokenizer).prompt_text("Q")


def test_a_template_that_ignores_tools_is_refused(tiny_tokenizer):
    from rlhf_lightning.config.errors import ConfigError
    from rlhf_lightning.rollout.episodes.chat import check_template

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    with pytest.raises(
        ConfigError, match=r"model.chat_template=.*renders tools= \(the prompt lacks calculator\)"
    ):
        check_template(ChatFormatter(tiny_tokenizer, tools=tools), multi_turn=False)


def test_chat_template_from_a_jinja_file(tmp_path):
    from rlhf_lightning.config import ASSETS
    from rlhf_lightning.config.errors import ConfigError
    from rlhf_lightning.models.build import read_chat_template

    path = ASSETS / "chat_templates" / "tools.jinja"
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ConfigError, match=r"model.chat_template=.*an existing .jinja file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def closing_with(closing: str, generation_prompt: str = "<|im_start|>assistant\n") -> str:
    """A ChatML-like template whose assistant turns end with ``closing``."""
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\n' + m['content'] + '" + closing + "' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + generation_prompt + "' }}{% endif %}"
    )


def test_the_text_after_a_reply_is_found_whatever_the_closing_contains(tiny_tokenizer, monkeypatch):
    """An assistant turn closed by text with an 'A' in it (the probe reply was 'A', found with
    rindex): the observation's ids still continue the reply exactly as the whole render does."""
    monkeypatch.setattr(tiny_tokenizer, "chat_template", closing_with("<|im_end|>\\nAck A\\n"))
    formatter = ChatFormatter(tiny_tokenizer)
    assert formatter.observation_text("next").startswith("\nAck A\n<|im_start|>user\nnext")
    formatter.check_prefix_stable()  # text and tokens: the harness's trajectories are the render's


def test_a_template_whose_turns_do_not_tokenize_as_assembled_is_refused(tiny_tokenizer, monkeypatch):
    """Prefix-stable as text, but the generation prompt is not the template's assistant header:
    the assembled trajectory's ids differ from the whole conversation's, so it is refused."""
    template = closing_with("<|im_end|>\\n", generation_prompt="<|im_start|>assistant:\\n")
    monkeypatch.setattr(tiny_tokenizer, "chat_template", template)
    with pytest.raises(ValueError, match=r"not token-exact.*from token \d+"):
        ChatFormatter(tiny_tokenizer).check_prefix_stable()
