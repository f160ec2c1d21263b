"""Shell completion: the scripts in completions/ are generated here from the Typer app, and
the names they complete (sessions, models, roles, the short names `models pull` knows) come
from quipu itself at Tab time.

    python -m quipu.cli.completion [DIR]   writes quipu.bash, _quipu (zsh) and quipu.fish
"""

from __future__ import annotations

import sys
from pathlib import Path

SHELLS = {"bash": "quipu.bash", "zsh": "_quipu", "fish": "quipu.fish"}
COMPLETE_VAR = "_QUIPU_COMPLETE"


def script(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name="quipu", complete_var=COMPLETE_VAR, shell=shell).strip() + "\n"


def complete_sessions(incomplete: str) -> list[str]:
    from quipu.app.environment import Environment
    from quipu.app.manage import session_names

    try:
        names = session_names(Environment.load())
    except Exception:  # completion must never print a traceback into the user's shell
        return []
    return [n for n in names if n.startswith(incomplete)]


def complete_models(incomplete: str) -> list[str]:
    from quipu.app.environment import Environment

    try:
        env = Environment.load()
        from quipu.models import discover

        names = [e.name for e in discover(env.dirs.models, env.environ, env.config.models)]
    except Exception:  # completion must never print a traceback into the user's shell
        return []
    return [n for n in names if n.lower().startswith(incomplete.lower())]


def complete_roles(incomplete: str) -> list[str]:
    from quipu.app.environment import Environment
    from quipu.app.roles import load_roles

    try:
        names = sorted(load_roles(Environment.load()))
    except Exception:  # completion must never print a traceback into the user's shell
        return []
    return [n for n in names if n.startswith(incomplete)]


def complete_short_names(incomplete: str) -> list[str]:
    from quipu.app.known_models import KNOWN

    return [n for n in KNOWN if n.startswith(incomplete.lower())]


def write_all(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for shell, filename in SHELLS.items():
        (folder / filename).write_text(script(shell))


if __name__ == "__main__":
    write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("completions"))
