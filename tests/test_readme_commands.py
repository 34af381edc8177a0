"""README's and docs' commands run as written after the two set-up commands (`make serve` / `make test`, which create
.venv): every shell command (fenced bash/sh/console blocks, `$ ` lines of transcripts, and inline code spans that
are commands) names an executable that exists after set-up — `.venv/bin/python` / `.venv/bin/<console script>`,
a Makefile target, curl — and the scripts, modules and subcommands it names exist. The cheap ones (`--help`,
`python -c`) are run; the rest (servers, training, examples, benchmarks) are skipped with the reason.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/architecture.md", "docs/contracts.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
BARE = ("python", "python3", "pytest", "pip", "pip3")  # only ever right as .venv/bin/<name>


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every ``` fenced block."""
    blocks = re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.M | re.S)
    return [(m.group(1).strip().lower(), m.group(2)) for m in blocks]


def split_commands(body: str) -> list[str]:
    """The commands of a shell block: a line, or several joined by a trailing backslash or an open quote; comments
    and blank lines dropped."""
    commands, buf = [], ""
    for line in body.splitlines():
        buf = f"{buf}\n{line}" if buf else line
        if buf.rstrip().endswith("\\"):
            buf = buf.rstrip()[:-1]
            continue
        try:
            words = shlex.split(buf, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        if words:
            commands.append(buf.strip())
        buf = ""
    assert not buf.strip(), f"unterminated command in a shell block: {buf[:200]!r}"
    return commands


def shell_commands(text: str) -> list[str]:
    """Commands of the fenced shell blocks, and the `$ ` lines of untyped blocks (transcripts with their output)."""
    out = []
    for lang, body in fenced_blocks(text):
        if lang in SHELL_LANGS:
            out += [c[2:] if c.startswith("$ ") else c for c in split_commands(body)]
        elif lang == "":
            out += [line[2:].strip() for line in body.splitlines() if line.startswith("$ ")]
    return out


def inline_commands(text: str) -> list[str]:
    """Inline code spans (outside fenced blocks) that are commands: they start with .venv/, make, a bare python /
    pytest / pip, or `vlserve` with flags. Names are not commands: one word (`.venv/bin/python`), a pattern with
    "..." (`.venv/bin/vlserve ...`), or `vlserve serve` alone."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    out = []
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        first = span.split(" ", 1)[0]
        if " " not in span or "..." in span:
            if first in BARE:
                out.append(span)  # a bare `python` is never right, even as a name
            continue
        if first.startswith(".venv/") or first == "make" or first in BARE or (first == "vlserve" and " -" in span):
            out.append(span)
    return out


def all_commands() -> list[tuple[str, str]]:
    return [(rel, cmd) for rel in DOCS for cmd in shell_commands(_read(rel)) + inline_commands(_read(rel))]


def makefile_targets() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_-]+):(?!=)", _read("Makefile"), re.M)}


def console_scripts() -> set[str]:
    """The names under pyproject.toml's [project.scripts] (what pip installs into .venv/bin)."""
    m = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", _read("pyproject.toml"), re.M | re.S)
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", m.group(1), re.M)) if m else set()


def vlserve_subcommands() -> dict[str, set[str]]:
    """{subcommand: its own subcommands} of the `vlserve` console script (parsing only: no torch)."""
    from vlserve.cli import build_parser

    def choices(parser: argparse.ArgumentParser) -> dict:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices
        return {}

    top = choices(build_parser())
    return {name: set(choices(sub)) for name, sub in top.items()}


def _module_exists(module: str) -> bool:
    if os.path.isdir(os.path.join(ROOT, module.split(".")[0])):  # vlserve, training, benchmarks, tools: this checkout's
        base = os.path.join(ROOT, *module.split("."))
        return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py"))
    import importlib.util

    return importlib.util.find_spec(module) is not None


def problems(cmd: str) -> list[str]:
    """What in `cmd` would not run after `make serve` / `make test` (empty: nothing)."""
    words = shlex.split(cmd, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return ["no command"]
    exe, args = words[0], words[1:]
    if exe in BARE or exe == "vlserve":
        return [f"{exe!r} is not on PATH after set-up: write .venv/bin/{exe}"]
    if exe == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        return [f"no Makefile target {t!r}" for t in targets if t not in makefile_targets()]
    if exe == "curl":
        return []  # talks to a running `make serve`
    if exe == "source":
        return [] if args and args[0] == ".venv/bin/activate" else [f"sources {args}"]
    if exe == ".venv-quant/bin/python":  # the llm-compressor venv that `make quant-tools` creates
        script = args[0] if args else ""
        return [] if os.path.isfile(os.path.join(ROOT, script)) else [f"no script {script!r}"]
    if not exe.startswith(".venv/bin/"):
        return [f"unknown executable {exe!r} (README commands use .venv/bin/..., make or curl)"]
    name = exe.rsplit("/", 1)[1]
    if name in ("python", "python3"):
        if args[:1] == ["-m"]:
            return [] if _module_exists(args[1]) else [f"no module {args[1]!r}"]
        if args[:1] == ["-c"]:
            return []
        script = args[0] if args else ""
        return [] if os.path.isfile(os.path.join(ROOT, script)) else [f"no script {script!r}"]
    if name not in console_scripts():
        return [f"{exe!r} is not a console script of this project ({sorted(console_scripts())})"]
    if name == "vlserve":
        subs = vlserve_subcommands()
        if not args or args[0] not in subs:
            return [f"no vlserve subcommand {args[:1]}; there are {sorted(subs)}"]
        if subs[args[0]] and (len(args) < 2 or args[1] not in subs[args[0]]):
            return [f"no `vlserve {args[0]}` subcommand {args[1:2]}; there are {sorted(subs[args[0]])}"]
    return []


def why_not_run(cmd: str) -> str | None:
    """None for commands cheap enough to run here (seconds); else why this test leaves it alone."""
    words = shlex.split(cmd, comments=True)
    if "--help" in words or "-h" in words:
        return None
    if words[:1] and words[0].endswith("/python") and words[1:2] == ["-c"]:
        return None
    if words[0] == "make":
        return "a set-up / long-running make target (the suite itself runs inside `make test`)"
    if words[0] == "curl":
        return "needs a running `make serve`; tests/api cover the endpoints"
    if any(w.startswith("examples/") for w in words):
        return "runs the demo model for tens of seconds; tests/demo/test_examples.py runs every example"
    return "starts a server, trains or benchmarks: minutes, not seconds"


COMMANDS = all_commands()


def test_docs_have_commands():
    """The extraction finds README's commands (guards against a parser that silently finds nothing)."""
    readme = [c for rel, c in COMMANDS if rel == "README.md"]
    assert "make serve" in readme and "make test" in readme
    assert any(c.startswith(".venv/bin/vlserve serve --help") for c in readme)
    assert any(c.startswith("curl ") for c in readme)


@pytest.mark.parametrize("rel,cmd", COMMANDS, ids=[f"{rel}:{cmd[:60]}" for rel, cmd in COMMANDS])
def test_command_refers_to_what_exists(rel, cmd):
    assert not problems(cmd), f"{rel}: `{cmd[:200]}`: {problems(cmd)}"


def test_problems_catches_what_fails_after_setup():
    assert problems("python -m training.eval")
    assert problems("vlserve serve --port 8001")
    assert problems(".venv/bin/python -m vlserve.no_such_module")
    assert problems(".venv/bin/python -m training.no_such_module")
    assert not problems(".venv/bin/python -m training.eval --help")
    assert problems(".venv/bin/python examples/no_such_example.py")
    assert problems("make no-such-target")
    assert problems(".venv/bin/vlserve bench no-such-bench")
    assert not problems(".venv/bin/vlserve bench mm-cache")
    assert not problems('make serve SERVE_ARGS="--port 8001"')


@pytest.mark.parametrize("rel,cmd", COMMANDS, ids=[f"{rel}:{cmd[:60]}" for rel, cmd in COMMANDS])
def test_cheap_commands_run(rel, cmd):
    reason = why_not_run(cmd)
    if reason is not None:
        pytest.skip(reason)
    words = shlex.split(cmd, comments=True)
    if not os.path.exists(os.path.join(ROOT, words[0])):
        pytest.skip(f"{words[0]} does not exist: run `make test` (it creates .venv)")
    proc = subprocess.run(
        words, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"}
    )
    assert proc.returncode == 0, (
        f"{rel}: `{cmd}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
    assert proc.stdout.strip(), f"`{cmd}` printed nothing"


def test_cheap_commands_are_found():
    assert any("--help" in cmd for _, cmd in COMMANDS if why_not_run(cmd) is None)
