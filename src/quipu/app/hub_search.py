"""The Hub's search (`quipu models search`): GGUF repositories by a text, most downloaded first,
each with what a pull of it would fetch (`hub.choose`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quipu.app.hub import REF, HubError, HubErrors, HubFile, choose, endpoint, reach_hub, repository_path
from quipu.errors import UsageError


@dataclass
class Found:
    """A GGUF repository the Hub's search found, and what a pull of it without a tag fetches."""

    repo: str
    downloads: int
    quant: str | None = None  # None: it has no GGUF file quipu would pull
    files: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # its other quantizations

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.repo, "downloads": self.downloads, "quant": self.quant, "files": self.files,
                "others": self.others}


MAX_FOUND = 100


def search(text: str, limit: int = 20) -> list[Found]:
    """The Hub's GGUF repositories that match `text`, most downloaded first (at most `limit`,
    itself at most MAX_FOUND), each with what `quipu models pull` would fetch of it."""
    if not text.strip():
        raise UsageError("give a text to search the Hub for (a model's name: gemma, qwen3, llama)")
    if not 1 <= limit <= MAX_FOUND:
        raise UsageError(f"--limit must be from 1 to {MAX_FOUND}, got {limit}")
    from huggingface_hub import HfApi

    found = []
    with HubErrors(text):
        reach_hub()
        try:
            listed = list(HfApi().list_models(search=text, filter="gguf", sort="downloads", limit=limit,
                                              expand=["downloads", "siblings"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HubError(f"{endpoint()} answered a search that cannot be read ({type(exc).__name__})") from None
    for info in listed:
        repo = getattr(info, "id", None)
        if not isinstance(repo, str) or REF.fullmatch(repo) is None:
            continue  # (not a name a pull could take)
        downloads = getattr(info, "downloads", 0)
        count = downloads if isinstance(downloads, int) and not isinstance(downloads, bool) else 0
        names = []
        for sibling in getattr(info, "siblings", None) or []:
            try:
                names.append(repository_path(getattr(sibling, "rfilename", None), repo))
            except HubError:
                continue  # (a name no pull would take: not shown)
        try:
            plan = choose(repo, [HubFile(name, 0, None) for name in names], None)
        except UsageError:  # no GGUF file, or a split model with parts missing: nothing to pull
            found.append(Found(repo, count))
            continue
        found.append(Found(repo, count, plan.quant, [f.path for f in plan.files], plan.others))
    return found
