"""The command blocks of README.md and of the docs site's pages run here, or say why they cannot.

Every fenced ``bash`` block of README.md and of the pages in ``mkdocs.yml``'s nav is either run,
command by command, or marked on the line before it with why it is not::

    <!-- not run: needs a GPU -->
    <!-- not run: network (downloads a model from the Hugging Face Hub) -->
    <!-- not run: serves until Ctrl-C -->

A marked block is reported as a skip with its reason (``pytest -rs tests/test_doc_blocks.py``
lists them all). How a block runs, each page in a temporary folder of its own, its blocks in order
(a later block may use what an earlier one made, as a reader's would):

- the folder links the repository's ``configs/``, ``examples/`` and ``results/``, and holds every
  Python block of the page whose first line is ``# name.py``, written as that file (``my_reward.py``,
  ``my_envs.py``), so that the commands find what the page told the reader to write;
- ``marft ...`` (also ``.venv/bin/marft``) runs in-process, ``marft.cli.main``, with :data:`TINY`
  appended to ``train``, ``eval`` and ``serve`` (the tiny random model of ``tests/conftest.py``, short
  replies, few episodes and problems) and :data:`TRAIN` to ``train`` (one iteration, no evaluation
  before training): a command whose real run trains for minutes checks here in seconds that its
  config, overrides and files work together. :data:`OVERRIDES` adds overrides to a particular
  command (a resumed run must extend its run). ``marft sweep`` runs as ``--dry-run`` (every run's
  config loaded and checked), ``marft report`` with ``--out`` in the temporary folder;
- ``bash scripts/setup.sh ...`` is taken as done: the tests run in the venv it made;
- anything else cannot run here and must be marked.

Python blocks are compiled (not run: most need a trained run or a GPU); YAML blocks are parsed.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

TINY = ["model.dtype=float32", "model.device=cpu", "rollout.max_new_tokens=8", "rollout.episodes=4",
        "team.max_new_tokens={}", "eval.problems=2", "eval.samples=1"]
"""Appended to every ``marft train``, ``eval`` and ``serve`` (with ``model.name=<the tiny model>``)."""
TRAIN = ["train.iterations=1", "train.eval_every=0", "train.save_every=1", "eval.before=false", "eval.ablate=false"]
"""Appended to every ``marft train`` after :data:`TINY`."""
OVERRIDES = {
    "train --resume runs/duo_short": ["train.iterations=2"],  # TRAIN's one iteration would end it at once
}
"""A substring of a command -> overrides appended after :data:`TINY` and :data:`TRAIN`."""

MARKED_HERE = {
    ("docs/gpu.md", "python scripts/gpu_check.py bundle"):
        "needs a GPU (scripts/gpu_check.sh runs on a lent one; tests/test_gpu_check.py runs its CPU dry run)",
}
"""Blocks of pages whose authors have not marked them yet: (page, the block's first line) -> why not run."""

SHELL = ("bash", "sh", "shell")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                   re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.*?)\s*-->\s*$")
WRITES = re.compile(r"^# (\w+\.py)\s*$")


@dataclass
class Block:
    page: str        # path from the repository's root
    line: int        # the fence's line, from 1
    lang: str
    body: str
    not_run: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """README.md and every page in the site's nav (pages that only include a root file have no blocks)."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    found: list[str] = []

    def walk(x):
        if isinstance(x, str):
            found.append(f"docs/{x}")
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(nav)
    return ["README.md", *[p for p in found if (ROOT / p).is_file()]]


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        why = NOT_RUN.search(before)
        first = m.group("body").split("\n", 1)[0]
        here = next((w for (p, start), w in MARKED_HERE.items() if p == page and first.startswith(start)), None)
        out.append(Block(page, line, m.group("lang").lower(), m.group("body"), why.group("why") if why else here))
    return out


ALL = [b for p in pages() for b in blocks(p)]
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL]


def commands(body: str) -> list[list[str]]:
    """The commands of a shell block: lines joined at ``\\``, comments dropped, split at ``&&``."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in out if c]


# ------------------------------------------------------------------------------------- running

@dataclass
class PageRun:
    folder: Path
    done: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)


_runs: dict[str, PageRun] = {}


def _page_run(page: str, tmp_path_factory) -> PageRun:
    if page not in _runs:
        folder = tmp_path_factory.mktemp(re.sub(r"\W", "_", page))
        for name in ("configs", "examples", "results"):
            (folder / name).symlink_to(ROOT / name, target_is_directory=True)
        for b in blocks(page):
            first = b.body.split("\n", 1)[0]
            if b.lang == "python" and WRITES.match(first):
                (folder / WRITES.match(first).group(1)).write_text(b.body)
        _runs[page] = PageRun(folder)
    return _runs[page]


def _marft(words: list[str], run: PageRun, tiny: Path, capsys) -> None:
    from marft.cli import main

    args = list(words[1:])
    command = next((a for a in args if not a.startswith("-")), "")
    text = " ".join(args)
    if command in ("train", "eval", "serve"):
        args += [f"model.name={tiny}", *TINY]
    if command == "train":
        args += TRAIN
    if command == "sweep":
        args.append("--dry-run")
    if command == "report":
        args += ["--out", str(run.folder / f"report-{len(run.done)}")]
    for key, extra in OVERRIDES.items():
        if key in text:
            args += extra
    rc = main(args)
    out = capsys.readouterr()
    assert rc == 0, f"marft {' '.join(args)} exited {rc}:\n{out.out[-3000:]}\n{out.err[-3000:]}"


def _run_block(block: Block, run: PageRun, tiny: Path, capsys) -> None:
    for words in commands(block.body):
        program = words[0]
        if program == "bash" and len(words) > 1 and words[1] == "scripts/setup.sh":
            continue  # the tests run in the venv it made
        if program == "marft" or program.endswith("/bin/marft"):
            _marft(words, run, tiny, capsys)
            continue
        raise AssertionError(f"{block.id}: cannot run {' '.join(words)!r} here; mark the block "
                             "<!-- not run: why --> on the line before it")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.id for b in SHELL_BLOCKS])
def test_shell_block(block, tiny_model_dir, tmp_path_factory, monkeypatch, capsys):
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: say why the block is not run"
        pytest.skip(f"not run: {block.not_run}")
    run = _page_run(block.page, tmp_path_factory)
    monkeypatch.chdir(run.folder)
    for earlier in [b for b in SHELL_BLOCKS if b.page == block.page and b.line < block.line]:
        if earlier.not_run is None and earlier.line not in run.done:  # what this block may build on
            if earlier.line in run.failed:
                pytest.fail(f"an earlier block of the page failed: {earlier.id}")
            _run_block(earlier, run, tiny_model_dir, capsys)
            run.done.add(earlier.line)
    if block.line in run.done:
        return
    try:
        _run_block(block, run, tiny_model_dir, capsys)
    except BaseException:
        run.failed[block.line] = True
        raise
    run.done.add(block.line)


def test_python_blocks_compile():
    for b in ALL:
        if b.lang in ("python", "py"):
            compile(b.body, b.id, "exec")


def test_yaml_blocks_parse():
    for b in ALL:
        if b.lang in ("yaml", "yml"):
            yaml.safe_load(b.body)


def test_the_block_parser():
    body = ("bash scripts/setup.sh && .venv/bin/marft train c.yaml   # a comment\n"
            "# a whole comment line\n"
            ".venv/bin/marft eval c.yaml 'tasks=[{kind: coop}]' \\\n  eval.problems=4\n")
    assert commands(body) == [["bash", "scripts/setup.sh"], [".venv/bin/marft", "train", "c.yaml"],
                              [".venv/bin/marft", "eval", "c.yaml", "tasks=[{kind: coop}]", "eval.problems=4"]]
    assert "README.md" in pages() and "docs/getting-started.md" in pages()
    marked = [b for b in SHELL_BLOCKS if b.not_run is not None]
    assert marked and all(b.not_run for b in marked)
