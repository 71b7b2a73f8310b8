"""Chat messages as token ids through the tokenizer's chat template, as transformers'
`apply_chat_template` and vLLM's chat endpoint render them, with the template variables a
caller adds (vLLM's `chat_template_kwargs`: Qwen3's `enable_thinking=False`, for one).
`specjax generate --chat`, its prompt files and `specjax serve` all render here."""

from __future__ import annotations

from typing import Any

from .errors import SpecjaxError


class ChatError(SpecjaxError):
    """Messages the chat template cannot render, or template variables it may not take."""


# apply_chat_template's own parameters: a template variable of one of these names would set
# the renderer's behaviour instead (vLLM refuses chat_template and tokenize and drops the
# rest; here each is refused by name, so that nothing asked for is lost unseen)
RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(value: Any, name: str) -> dict[str, Any]:
    """`value` (None: none) checked as template variables: an object of string keys, none
    of them RESERVED; a ChatError naming `name` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ChatError(f"{name} must be an object of chat template variables, got {value!r:.80}")
    clash = sorted(set(value) & RESERVED)
    if clash:
        raise ChatError(f"{name} may not set {', '.join(clash)} (arguments of the renderer, not template "
                        "variables)")
    return dict(value)


def render(tokenizer: Any, messages: list[dict], variables: dict[str, Any] | None = None, *,
           add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template, with `variables`
    (`template_kwargs`) in the template's scope. add_generation_prompt: end with the
    assistant's header; continue_final_message: leave the last message open for the model
    to go on with (not both). A ChatError where the tokenizer has no template or the
    template fails (its own checks of roles and order raise jinja's errors)."""
    if add_generation_prompt and continue_final_message:
        raise ChatError("add_generation_prompt and continue_final_message cannot both be true")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the tokenizer has no chat template to format messages with")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tokenize=True,
                                            return_dict=False, **(variables or {}))
    except Exception as e:  # the template's own errors, of several kinds
        raise ChatError(f"the chat template failed on these messages: {e}") from None
    return [int(i) for i in ids]
