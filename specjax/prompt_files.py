"""Prompt files: read, checked and tokenized, for `specjax generate --batch` and
drafter training (`python -m train.dflash --prompt-file FILE` or `--prompt-dir DIR`).

- JSONL (a ``.jsonl`` file, or one whose first non-empty line starts with ``{``): one
  object per line, either ``{"prompt": "text"}`` or ``{"messages": [{"role": ..,
  "content": ..}, ..]}``. Messages are always formatted by the tokenizer's chat template
  (with the assistant's turn opened; `specjax.chat`); a plain prompt is tokenized as it is, or as one
  user message with ``chat=True`` (``--chat``).
- Plain text: one prompt per line; blank lines separate nothing and are skipped.
- A folder: every regular file in it or its subfolders is one prompt (its whole text), by
  sorted path; hidden files and folders (a name starting with ".", such as .git) are left out.

Files are UTF-8 (a leading byte-order mark is dropped; CRLF and CR end lines as LF does);
lines end only at those, not at the other characters `str.splitlines` breaks at (form
feed, U+2028, ..), which JSON strings and source text may hold. A byte that is not UTF-8,
a line that is not a JSON object, a key other than those two, an empty prompt and a file
without prompts are each a :class:`PromptError` naming the file and line. Prompts are
kept as token ids with where they came from, so later checks (a prompt too long for the
data plan) can name it too.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
from pathlib import Path
from typing import Any

from .chat import ChatError, render
from .errors import PromptError

KEYS = ("prompt", "messages")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One tokenized prompt and where it came from ("file:line" or a file)."""

    where: str
    ids: tuple[int, ...]


def _template(tokenizer: Any, messages: list[dict], where: str, template_kwargs: dict[str, Any] | None
              ) -> list[int]:
    try:
        return render(tokenizer, messages, template_kwargs)
    except ChatError as e:
        raise PromptError(f"{where}: {e}") from None


def _messages(value: Any, where: str) -> list[dict]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise PromptError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}')
    if not any(m["content"].strip() for m in value):
        raise PromptError(f"{where}: the prompt is empty (every message's content is blank)")
    return value


def tokenize(text_or_messages: str | list[dict], tokenizer: Any, chat: bool, where: str,
             template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """One prompt as token ids: messages (or text with `chat`) through the chat template,
    with `template_kwargs` among its variables (`specjax.chat.render`)."""
    if isinstance(text_or_messages, str):
        if not text_or_messages.strip():
            raise PromptError(f"{where}: the prompt is empty")
        if not chat:
            ids = tokenizer(text_or_messages)["input_ids"]
            return Prompt(where, tuple(int(i) for i in ids))
        text_or_messages = [{"role": "user", "content": text_or_messages}]
    return Prompt(where, tuple(_template(tokenizer, text_or_messages, where, template_kwargs)))


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are distinct: json.loads would keep the last of a repeated
    key and drop the others unseen."""
    keys = [k for k, _ in pairs]
    repeated = next((k for k in keys if keys.count(k) > 1), None)
    if repeated is not None:
        raise ValueError(f"key {repeated!r} repeated")
    return dict(pairs)


def _record(line: str, where: str) -> str | list[dict]:
    try:
        record = json.loads(line, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise PromptError(f"{where}: not a JSON object ({e.msg})") from None
    except ValueError as e:  # _object's
        raise PromptError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(record, dict):
        raise PromptError(f"{where}: not a JSON object")
    unknown = sorted(set(record) - set(KEYS))
    if unknown:
        raise PromptError(f'{where}: unknown key {unknown[0]!r}: a line holds "prompt" or "messages"')
    if len(record) != 1:
        raise PromptError(f'{where}: a line holds exactly one of "prompt" or "messages"')
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise PromptError(f'{where}: "prompt" must be a string')
        return record["prompt"]
    return _messages(record["messages"], where)


def read_text(path: Path) -> str:
    """The file's text (module docstring: UTF-8, a BOM dropped, newlines as LF). Bytes that are
    not UTF-8 are refused, naming the line, rather than replaced, so no prompt changes unseen."""
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PromptError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_prompt_file(path: str | Path, tokenizer: Any, chat: bool = False,
                     template_kwargs: dict[str, Any] | None = None) -> list[Prompt]:
    """Every prompt of a JSONL or plain-text file (module docstring), in file order;
    `template_kwargs` as `tokenize`."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"--prompt-file {path}: no such file")
    lines = [(n, line) for n, line in enumerate(read_text(path).split("\n"), 1) if line.strip()]
    if not lines:
        raise PromptError(f"{path}: no prompts (the file is empty)")
    jsonl = path.suffix == ".jsonl" or lines[0][1].lstrip().startswith("{")
    return [tokenize(_record(line, f"{path}:{n}") if jsonl else line, tokenizer, chat, f"{path}:{n}",
                     template_kwargs) for n, line in lines]


def read_prompt_dir(path: str | Path, tokenizer: Any, chat: bool = False) -> list[Prompt]:
    """One prompt per regular file of the folder and its subfolders (its whole text), by
    path, less hidden ones (module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise PromptError(f"--prompt-dir {path}: not a directory")
    files = sorted(f for f in path.rglob("*")
                   if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts))
    if not files:
        raise PromptError(f"{path}: no prompt files")
    return [tokenize(read_text(f), tokenizer, chat, str(f)) for f in files]
