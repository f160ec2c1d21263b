"""The README and the pages of docs/ as a newcomer reads them: every shell example runs as
written, on the bundled model, and what they say of the chat's commands is what the chat has.

Each line of a ```sh block is a command, run in order with bash (`pipefail`: quipu's own exit
counts), in a fresh home, in a folder that holds the files the examples name. A block that
needs what a test machine does not have (the Hub, a server, an install) says so on the line
before it: `<!-- not run: WHY -->`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: .+ -->")

# The files the examples name, as a user would have them.
FILES = {
    "notes.txt": "Meeting on Monday: ship the release on Friday; Ana writes the notes.\n",
    "paper.txt": "Rayleigh scattering by A. Strutt and B. Lee. " * 40 + "\n",
    "questions.txt": "What is the capital of France?\nName a river.\n",
    "rows.jsonl": '{"id": "a", "prompt": "Say hi."}\n{"id": "b", "messages": [{"role": "user", "content": "Say bye."}]}\n',
    "sentences.txt": "The sky is blue.\nGrass is green.\n",
    "invoice.txt": "Invoice 17. Total: 42.50 EUR. Due on 2026-12-31.\n",
    "person.schema.json": '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, '
                          '"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], '
                          '"additionalProperties": false}\n',  # (a small model given room invents keys past -n)
    "reply.json": '{"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80}}, '
                  '"required": ["answer"]}\n',
    "yes-no.gbnf": 'root ::= "yes" | "no"\n',
    "sql.lark": 'start: "SELECT name FROM cities ORDER BY " COLUMN " DESC LIMIT 10"\nCOLUMN: "population" | "area"\n',
    "tools.py": 'def get_weather(city: str) -> dict:\n    """The weather in a city, today."""\n'
                '    return {"city": city, "temperature": 21}\n',
    "defs.json": '[{"type": "function", "function": {"name": "book", "description": "Book a trip", "parameters": '
                 '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]\n',
    "fixed.jinja": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}
# Programs an example uses that quipu does not install: a line needing one that is missing is
# left out, and said.
OTHERS = ("jq", "git")


def examples(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of each line of the page's ```sh blocks that are to run."""
    out, inside, skip, before = [], False, False, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip() == "```sh" and not inside:
            inside, skip = True, bool(NOT_RUN.fullmatch(before.strip()))
        elif line.strip() == "```" and inside:
            inside = False
        elif inside and not skip and out and out[-1][1].endswith("\\"):  # a command's next line
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        elif inside and not skip and line.strip() and not line.lstrip().startswith("#"):
            out.append((number, line))
        if line.strip():
            before = line
    return out


def test_every_page_is_reached_from_the_readme_and_the_readme_is_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name
    first_screen = "\n".join(readme.splitlines()[:40])
    assert "pip install" in first_screen and "demonstration" in first_screen and "gemma3:1b" in first_screen
    # (the first install's compile of llama.cpp, silent for minutes: said, with how to watch it)
    assert "compiles llama.cpp" in first_screen and "pip install -v" in first_screen


def test_the_chat_s_commands_are_all_in_its_page_and_the_readme():
    from quipu.cli.slash import COMMANDS

    for page in (ROOT / "docs" / "chat.md", ROOT / "README.md"):
        text = page.read_text()
        table = [line for line in text.splitlines() if line.startswith("| `/")]
        for command in COMMANDS:
            assert any(f"`/{command.name}" in line for line in table), (page.name, command.name)


@pytest.mark.model
@pytest.mark.parametrize("page", [p for p in PAGES if examples(p)], ids=lambda p: p.name)
def test_the_examples_run_as_written(page, tmp_path, bundled_model):
    lines = examples(page)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    for name, text in FILES.items():
        (work / name).write_text(text)
    (work / "completions").symlink_to(ROOT / "completions")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("QUIPU_", "HF_", "OLLAMA_"))}
    environ.update(QUIPU_HOME=str(home / "quipu"), HOME=str(home), HF_HUB_OFFLINE="1", NO_COLOR="1",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + environ.get("PATH", ""))
    config = home / "quipu" / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("[generation]\nmax_tokens = 200\nseed = 7\n")  # (the answers' length does not matter here;
    # a fixed seed makes a run the same each time)
    if shutil.which("git"):  # a change for `git diff` to show
        git = ["git", "-c", "user.email=a@b.c", "-c", "user.name=a"]
        subprocess.run([*git, "init", "-q"], cwd=work, check=True)
        subprocess.run([*git, "add", "notes.txt"], cwd=work, check=True)
        subprocess.run([*git, "commit", "-qm", "notes"], cwd=work, check=True)
        (work / "notes.txt").write_text(FILES["notes.txt"] + "Ben brings the slides.\n")
    left_out = []
    for number, command in lines:
        missing = [p for p in OTHERS if re.search(rf"(^|[|;&]\s*){p}\b", command) and shutil.which(p) is None]
        if missing:
            left_out.append(f"{page.name}:{number} (needs {', '.join(missing)})")
            continue
        r = subprocess.run(["bash", "-c", "set -o pipefail\n" + command], cwd=work, env=environ,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
        said = r.stderr.decode(errors="replace")
        assert r.returncode == 0 and "Traceback" not in said, f"{page.name}:{number}: {command}\n{said}"
    if left_out:
        import warnings

        warnings.warn("examples left out, their programs missing: " + "; ".join(left_out), stacklevel=1)


def test_the_docs_say_where_the_tests_keep_what_they_make(monkeypatch, tmp_path):
    from conftest import cache_dir

    said = (ROOT / "docs" / "layout.md").read_text()  # (the README's set-up points there)
    assert "~/.cache/quipu-tests" in said and "QUIPU_TEST_CACHE" in said
    assert "docs/layout.md#tests" in (ROOT / "README.md").read_text()
    monkeypatch.delenv("QUIPU_TEST_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "quipu-tests"
    monkeypatch.setenv("QUIPU_TEST_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
