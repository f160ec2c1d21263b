"""What a chat template does, for `quipu models info --template`."""

from __future__ import annotations

from quipu.errors import TemplateError
from quipu.sessions.template import ChatTemplate


def template_features(source: str | None) -> dict[str, bool | str]:
    """The features a template uses (system role, thinking and its switch, tools), or why it
    cannot be read; a model without one gets ChatML's."""
    try:
        template = ChatTemplate(source)
    except TemplateError as exc:
        return {"error": str(exc)}
    return {"fallback": template.is_fallback, **template.features()}
