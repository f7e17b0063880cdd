"""``--chat-template``: the chat template the scheduler renders chat requests with, as vLLM's flag takes it (a Jinja
file, or the template itself), for a checkpoint without one or instead of its own. It is read and compiled at
start-up, so that a missing file or a template with a syntax error stops the start in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

FLAG = "--chat-template"
TEMPLATE_MARKS = ("{{", "{%", "\n")  # what makes a value a template rather than a file name (as vLLM tells them)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:57] + "...")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # (a name too long for the OS: a template)
        return False


def load_chat_template(value: str) -> str | None:
    """The template ``value`` names (its file's text) or is; None when it is empty (the checkpoint's own serves).
    ValueError, one line naming the flag, when the file cannot be read or the template does not compile."""
    if not value:
        return None
    path = Path(value).expanduser()
    if any(mark in value for mark in TEMPLATE_MARKS) and not _is_file(path):  # (inline: not a name the OS takes)
        text = value
    elif path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{FLAG} {value}: cannot read it: {err}") from None
    else:
        raise ValueError(f"{FLAG} {_shown(value)}: no such file (a template given inline has {{{{ or {{%)")
    check_compiles(text, value)
    return text


def check_compiles(text: str, value: str) -> None:
    """Compiles ``text`` in the environment chat requests are rendered in (transformers' sandbox)."""
    import jinja2

    from scheduler_svc.tokenizer import _compile as compile_template

    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{FLAG} {_shown(value)}: the template does not compile: {err.message} (line "
                         f"{err.lineno})") from None


def use_chat_template(tokenizer, template: str | None, log) -> None:
    """Makes ``template`` the tokenizer's chat template (what every chat request renders, and what the tool-call
    parser is picked from); nothing when it is None."""
    if template is None:
        return
    had = getattr(tokenizer, "chat_template", None) is not None
    tokenizer.chat_template = template
    log.info("chat_template", source=FLAG, replaces_checkpoint_template=had, chars=len(template))
