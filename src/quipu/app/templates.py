"""What a chat template does, for `quipu models info --template`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quipu.errors import TemplateError
from quipu.sessions.template import ChatTemplate

if TYPE_CHECKING:
    from quipu.app.environment import Environment


def template_features(source: str | None) -> dict[str, bool | str]:
    """The features a template uses (system role, thinking and its switch, tools, and whose
    format its tool calls take), or why it cannot be read; a model without one gets ChatML's."""
    from quipu.sessions.tools import format_of

    try:
        template = ChatTemplate(source)
    except TemplateError as exc:
        return {"error": str(exc)}
    fmt = format_of(template.source)
    return {"fallback": template.is_fallback, **template.features(),
            "tool_format": "generic" if fmt.generic else fmt.families}


def repository_template(env: Environment, path: Path, own: str | None) -> str | None:
    """The chat template file the repository of a pulled model ships, when it says something
    else than the GGUF's own (a fix made after the file was converted); None otherwise."""
    from quipu.store.pulled import PulledRecord

    for model in PulledRecord(env.dirs.models).all().values():
        if model.path == str(path) and model.template:
            try:
                text = Path(model.template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                return None
            return model.template if text.strip() != (own or "").strip() else None
    return None
