"""``--chat-template``: a Jinja chat template, given as a file path or inline, that replaces the
model's for the life of the server (chat completions and ``/tokenize`` alike).

The template is read and parsed when the server starts, so a missing file or a syntax error stops
it with a message instead of failing every chat request.
"""

from __future__ import annotations

import os


def load_chat_template(value: str) -> str:
    """The template text: the file ``value`` names, else ``value`` itself when it reads as a
    template. ValueError for neither, or for a template that does not parse."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment HF tokenizers render templates in (loop controls on).
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not parse: line {e.lineno}: {e.message}") from None
    return template


def install_chat_template(tokenizer, template: str) -> None:
    """Make ``template`` the tokenizer's, so every caller of its apply_chat_template renders it."""
    if tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    tokenizer.chat_template = template
