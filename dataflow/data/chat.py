"""Chat records rendered with a model's chat template as transformers renders it (a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, loop controls, its tojson filter,
raise_exception, strftime_now and the {% generation %} tag; the named special tokens passed in),
and the character spans of the assistant's turns, which are the only text that carries loss.
Never tokenises and never reads files.

The spans: a template with {% generation %} blocks marks them itself (transformers'
return_assistant_tokens_mask). Otherwise assistant turn i spans from the end of the rendering of
messages[:i] with the generation prompt (for a first message: from where its content starts,
after the default system turn or BOS a template may write first) to the end of the rendering of
messages[:i + 1]: its content and the end-of-turn text the template writes after it (<|im_end|>
and its newline), so the model learns to stop. A template that renders earlier turns differently
once later turns follow (some strip an earlier turn's reasoning) has no such prefixes; then each
assistant content is found in order in the whole rendering (or, where the template drops the
reasoning of an earlier turn as Qwen3's does, its part after </think>), with the added token and
the newline after it."""

from __future__ import annotations

import json
import re
from datetime import datetime

import numpy as np

from dataflow.models.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
"""Roles every template is taken to know; another role must appear in the template's text."""
_PROBE = "DataflowContentProbe"
"""Stands in for a first assistant message's content to find where the content starts."""


class ChatError(ValueError):
    """A record the template cannot render (the message says why; the caller names the record)."""


class ChatTemplate:
    """One compiled chat template with the special tokens it is rendered with."""

    def __init__(self, template: str, special_tokens: dict, added_tokens: tuple[str, ...] = ()):
        self.source = template
        self.special_tokens = dict(special_tokens)
        self.added_tokens = added_tokens
        self._template = _compile(template)
        self.tracks_generation = _has_generation_tag(template)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return self._render(messages, add_generation_prompt, None)

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) character spans of its assistant
        turns (see the module's docstring)."""
        check_messages(messages, self.source)
        if self.tracks_generation:
            spans: list[tuple[int, int]] = []
            return self._render(messages, False, spans), spans
        text = self.render(messages)
        spans = self._prefix_spans(messages, text)
        return text, spans if spans is not None else self._content_spans(messages, text)

    def _render(self, messages, add_generation_prompt, spans):
        try:
            if spans is None:
                return self._template.render(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **self.special_tokens)
            blocks: list[str] = []
            with self._template.environment.activate_tracker(blocks, spans):
                for block in self._template.generate(
                        messages=messages, tools=None, documents=None,
                        add_generation_prompt=add_generation_prompt, **self.special_tokens):
                    blocks.append(block)  # one at a time: a span's start reads them
            return "".join(blocks)
        except Exception as exc:  # jinja2's TemplateError, or the template's own bad access
            raise ChatError(f"the chat template refused it: {exc}") from None

    def _prefix_spans(self, messages, text):
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self.render(messages[:i], add_generation_prompt=True) if i else \
                self._opening(m)
            # the whole conversation's rendering is the last turn's end: one render fewer
            end = text if i + 1 == len(messages) else self.render(messages[:i + 1])
            if start is None or not (text.startswith(end) and end.startswith(start)):
                return None
            spans.append((len(start), len(end)))
        return spans

    def _opening(self, message):
        """What the template writes before a first message's content (a default system turn,
        a BOS, the turn's header): the rendering of the message with a probe for its content,
        up to the probe; None when the probe does not come through."""
        try:
            probe = self.render([{**message, "content": _PROBE}])
        except ChatError:
            return None
        at = probe.find(_PROBE)
        return probe[:at] if at >= 0 else None

    def _content_spans(self, messages, text):
        spans, cursor = [], 0
        for m in messages:
            if m["role"] != "assistant":
                continue
            at, content, follow = -1, "", ""
            for content in _visible_forms(_content_text(m)):
                at, follow = self._find_reply(text, content, cursor)
                if at >= 0:
                    break
            if at < 0:
                raise ChatError("an assistant message's content does not appear in the rendered "
                                "conversation, so its tokens cannot be found")
            end = at + len(content) + len(follow)
            if follow:  # the newline a template writes after its end-of-turn token, as the
                end += len(text[end:]) - len(text[end:].lstrip("\n"))  # prefix rule learns it
            spans.append((at, end))
            cursor = end
        return spans

    def _find_reply(self, text: str, content: str, cursor: int) -> tuple[int, str]:
        """(where `content` is in `text` from `cursor`, the added token right after it): the
        first place an added token (the end of a turn) follows it, else the first place at all
        (a short reply such as 'd' is also inside '<|im_end|>')."""
        first, at = text.find(content, cursor), text.find(content, cursor)
        while at >= 0:
            follow = next((t for t in self.added_tokens if text.startswith(t, at + len(content))),
                          "")
            if follow:
                return at, follow
            at = text.find(content, at + 1)
        return first, ""


def check_messages(messages, template_text: str) -> None:
    """ChatError for what no template renders: not a non-empty list of {role, content} objects,
    a role neither in ROLES nor in the template's text."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'messages' must be a non-empty list of {{role, content}} objects, got "
                        f"{_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"message {i} is {_short(m)}; each message needs a string 'role'")
        if "content" not in m and "tool_calls" not in m:
            raise ChatError(f"message {i} (role '{m['role']}') has no 'content'")
        role = m["role"]
        if role not in ROLES and role not in template_text:
            raise ChatError(f"message {i} has role '{role}', which the chat template does not "
                            f"know; use one of {', '.join(ROLES)}")


def assistant_token_mask(offsets, spans) -> np.ndarray:
    """Per token (offsets: (n, 2) character ranges [a, b)), does it overlap an assistant span?
    transformers' rule for assistant_masks, vectorised: walking the tokens in order, a span is
    passed once a token starts at or after its end, and a token is learnt when it ends after the
    start of the first span not passed (so a token cut by a span's edge counts)."""
    off = np.asarray(offsets, np.int64).reshape(-1, 2)
    if not len(spans) or not off.size:
        return np.zeros(len(off), bool)
    sp = np.asarray(spans, np.int64).reshape(-1, 2)
    passed = np.maximum.accumulate(np.searchsorted(sp[:, 1], off[:, 0], side="right"))
    live = passed < len(sp)
    mask = np.zeros(len(off), bool)
    mask[live] = off[live, 1] > sp[passed[live], 0]
    return mask


def _visible_forms(content: str) -> tuple[str, ...]:
    """The content as a template may show it: whole, or (Qwen3's and DeepSeek-R1's templates
    drop an earlier turn's reasoning) the part after its last </think>."""
    if "</think>" not in content:
        return (content,)
    return content, content.split("</think>")[-1].lstrip("\n")


def _content_text(message) -> str:
    content = message.get("content", "")
    if isinstance(content, list):  # content blocks: the text ones, as templates join them
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return str(content)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _has_generation_tag(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _compile(template: str):
    """The template in transformers' environment (utils/chat_template_utils.py)."""
    try:
        import jinja2  # the data extra: only for chat data
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat data needs the jinja2 library to render the chat template "
                          "(pip install 'dataflow[data]')") from None

    class GenerationTracker(Extension):
        """{% generation %} ... {% endgeneration %}: records the body's character span."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate)
            self._state = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body) \
                .set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if self._state is not None:
                blocks, spans = self._state
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        def activate(self, blocks, spans):
            tracker = self

            class _Active:
                def __enter__(self):
                    tracker._state = (blocks, spans)

                def __exit__(self, *exc):
                    tracker._state = None

            return _Active()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatError(f"the chat template is not valid Jinja (line {exc.lineno}: "
                        f"{exc.message})") from None
