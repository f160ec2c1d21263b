"""What a host is: where the model runs, a local model (`local.py`), llama.cpp's llama-server
driven by tokens (`llama_server.py`), or any server's OpenAI chat API (`chat_api.py`); chosen
once per command (`choose.py`). A host makes the `ModelSession` a conversation runs on, and the small part of
a named session that differs between them (`Keeper`: what it writes besides the transcript's
messages). Everything else, turns, named sessions, the chat, is written once above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.engine.base import ProgressFn
from quipu.errors import InvalidParameter, SnapshotError
from quipu.sessions.base import Capabilities, ModelSession
from quipu.sessions.params import SamplingParams

if TYPE_CHECKING:
    from typing import Sequence

    from quipu.app.attachments import Attachment
    from quipu.app.prompt_cache import CacheUse
    from quipu.store.store import SessionStore
    from quipu.store.transcript import Transcript


S = TypeVar("S", bound=ModelSession, contravariant=True)


class Keeper(Protocol[S]):
    """What one named session keeps on its host besides its messages (its host's kind of session, `S`)."""

    @property
    def model_name(self) -> str: ...

    @property
    def model_fingerprint(self) -> str | None:
        """The model file's fingerprint (None: a model on a server)."""

    def write_behind(self) -> None:
        """From now on (a chat's), a save takes the state's bytes and writes them while the user
        types; `wait` waits for that write and says what went wrong with it. (Hosts that keep no
        state file here write nothing behind.)"""

    def wait(self) -> list[str]: ...

    def fields(self, session: S) -> dict[str, Any]:
        """The transcript's fields that depend on the host: model, params, context, tokens,
        n_decoded, draws, build, served."""

    def save(self, store: "SessionStore", name: str, record: "Transcript", session: S,
             next_keeps: Callable[[], int] | None = None) -> list[str]:
        """Writes the session (the transcript, and a state file where the host keeps one); notices.
        `next_keeps`: how many of the context's tokens the next turn is expected to keep."""

    def warm(self, session: S, tokens: Callable[[], list[int]]) -> CacheUse | None:
        """Before a new context's first turn: restores what the prompt cache holds of its
        prompt, `tokens()` (local models, unless --no-cache); the cache's use, or None."""

    def remember(self, session: S, use: CacheUse | None) -> list[str]:
        """After a one-shot answer is out: keeps its prompt and answer in the prompt cache; notices."""

    def cached(self, session: S, tokens: list[int]) -> int:
        """How many of `tokens` the prompt cache would restore (`--show-prompt`)."""

    def model_for_new(self, opts: TurnOptions, env: Environment) -> str | None:
        """The model a new session started from this one takes (`/new`), as it names it."""

    def take_media(self, session: S, store: "SessionStore | None", media: "Sequence[Attachment]") -> str:
        """Makes a message's images and recordings ready in the session (their bytes kept in
        `store`, a named session's; the projector the keeper was given, else the one beside the
        model): their markers, for the message's text; refused in one line where they cannot be."""

    def trim_media(self, session: S, texts: "Sequence[str]") -> list[str]:
        """Forgets the media the session took last that neither its context nor `texts` (its
        messages) name any more (an image whose exchange was undone); their SHA-256s."""


T = TypeVar("T", bound=ModelSession)


@dataclass
class Opened(Generic[T]):
    """A session opened on a host, with its keeper (of its kind of session) and what to tell the user."""

    session: T
    keeper: Keeper[T]
    notices: list[str] = field(default_factory=list)
    # The marker of each of `create`'s media, made ready, in their order: where each goes in a text.
    media_marks: list[str] = field(default_factory=list)
    # A resumed session's context is read again from its messages (another model's, or a host
    # that holds no tokens): their marks of the context (`context_before`) mean nothing here.
    reread: bool = False


class ModelHost(Protocol):
    """Where sessions run. Each host's own sessions and keepers pair up in its `Opened` (a
    local host's `Opened[InferenceSession]`); callers above see any host's (`Opened[Any]`)."""

    capabilities: Capabilities

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: "Sequence[Attachment]" = ()) -> Opened[Any]:
        """A new, empty session (the model loaded, with its load time in the stats); `name`,
        the named session it starts (None: a one-shot); `media`, the images and recordings its
        first message carries (a host without the "media" capability is given none)."""

    def resume(self, store: "SessionStore", name: str, record: "Transcript", opts: TurnOptions, env: Environment,
               on_progress: ProgressFn | None = None) -> Opened[Any]:
        """A saved session, its context restored where it can be, else read again (`Opened.reread`)."""

    def close(self) -> None: ...


class NoCache:
    """The part of a keeper that is about context state, for hosts that keep none here: no
    prompt cache, nothing written behind."""

    model_fingerprint: str | None = None

    def write_behind(self) -> None:
        pass  # (nothing is written behind: there is no state file here)

    def wait(self) -> list[str]:
        return []

    def warm(self, session: ModelSession, tokens: Callable[[], list[int]]) -> CacheUse | None:
        return None

    def remember(self, session: ModelSession, use: CacheUse | None) -> list[str]:
        return []

    def cached(self, session: ModelSession, tokens: list[int]) -> int:
        return 0

    def model_for_new(self, opts: TurnOptions, env: Environment) -> str | None:
        return opts.model

    def take_media(self, session: ModelSession, store: SessionStore | None, media: Sequence[Attachment]) -> str:
        from quipu.app.attachments import session_refusal

        raise session_refusal(media[0])

    def trim_media(self, session: ModelSession, texts: Sequence[str]) -> list[str]:
        return []


def saved_params(store: "SessionStore", name: str, record: "Transcript") -> SamplingParams:
    """A transcript's sampling parameters; damaged ones are said, and the file left as it is."""
    try:
        return SamplingParams.from_dict(record.params)
    except (TypeError, InvalidParameter) as exc:
        raise SnapshotError(f"session '{name}' is damaged: {exc}; {store.transcript_path(name)} was left "
                            "as it is") from None


def made_elsewhere(name: str, record: "Transcript", model_name: str) -> str:
    """The notice for a session continued on another model (its context is read again from the
    messages: `Opened.reread`)."""
    return (f"session '{name}' was made with {record.model.get('name', 'another model')}; continuing with "
            f"{model_name}, re-read from the transcript")
