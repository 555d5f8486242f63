"""MkDocs hooks of marft's docs site (``mkdocs.yml``: ``hooks: [scripts/docs_hooks.py]``).

What the site needs that MkDocs does not do by itself:

1. **Pages that show a file of the repository's root.** A line ``<!-- include: RESULTS.md -->`` in a
   page is replaced by that file, its links rebased from the root to the page. README.md,
   RESULTS.md and BENCHMARKS.md stay where readers and other documents cite them, and a link to one
   of them from any page goes to the page that shows it.
2. **Links to repository files outside docs/** (``configs/...``, ``examples/...``, ``results/...``,
   written relative to the page, so that they work on GitHub too): each must name a file that
   exists, or the build fails (a folder, a path outside the repository and a missing file are
   errors, strict mode or not). The file is copied into the site under ``_repo/`` and the link
   points there, so the built site stands alone.
3. **The reference generated from the code.** ``<!-- generated: config-reference -->`` becomes
   every config key with its type, default and docstring, read from the dataclasses of
   ``marft/run/config.py``; ``<!-- generated: cli-reference -->`` the help of every ``marft`` command,
   from ``marft/cli.py``'s argparse parser. (The Python API is mkdocstrings' ``:::`` blocks; the
   Sphinx roles of the docstrings, ``:func:`gae```, are dropped from their HTML.)

Links inside code (fenced blocks, inline code) are left alone: only Markdown links and images are
read, ``[text](target)`` and ``![alt](target)``.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

INCLUDE = re.compile(r"^<!-- include: (\S+) -->[ \t]*$", re.M)
GENERATED = re.compile(r"^<!-- generated: ([a-z-]+) -->[ \t]*$", re.M)
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[^\n]*\n.*?^\1\2[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
# [text](target "title") and ![alt](target); the text may hold inline code and one level of brackets
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\[\]]*\])*\])\(<?([^()\s<>]+)>?((?:\s+\"[^\"]*\")?)\)")
REPO_DIR = "_repo"  # where files of the repository outside docs/ go in the site

_state: dict = {}


# ------------------------------------------------------------------------------------------ links

def _repo_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _includes(files) -> dict[str, str]:
    """Root file (``RESULTS.md``) -> the page (src_uri) that includes it."""
    shown = {}
    for f in files.documentation_pages():
        for name in INCLUDE.findall(Path(f.abs_src_path).read_text(encoding="utf-8")):
            shown[posixpath.normpath(name)] = f.src_uri
    return shown


def _outside_code(text: str, fn) -> str:
    """Apply ``fn`` to every link of ``text`` outside fenced blocks and inline code."""
    out, pos = [], 0
    for m in FENCE.finditer(text):
        out.append(_links(text[pos:m.start()], fn))
        out.append(m.group(0))
        pos = m.end()
    out.append(_links(text[pos:], fn))
    return "".join(out)


def _links(text: str, fn) -> str:
    code: list[str] = []

    def hide(m: re.Match) -> str:
        code.append(m.group(0))
        return f"\x00{len(code) - 1}\x00"

    masked = LINK.sub(fn, INLINE_CODE.sub(hide, text))  # a link's text may hold inline code: kept hidden
    return re.sub("\x00(\\d+)\x00", lambda m: code[int(m.group(1))], masked)


def _rewrite(text: str, source: str, page: str, ctx: dict, errors: list[str]) -> str:
    """Rewrite the links of ``text``, written in the repository file ``source`` (a path from the
    repository's root), for the docs page ``page`` (a path from docs/)."""
    root, docs = ctx["root"], ctx["docs"]
    page_dir = posixpath.dirname(page)

    def one(m: re.Match) -> str:
        label, target, title = m.group(1), m.group(2), m.group(3)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)  # a URL, an anchor of this page, or a site-absolute path
        path, _, anchor = target.partition("#")
        anchor = f"#{anchor}" if anchor else ""
        if not path:
            return m.group(0)
        full = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        where = f"{source}: link to {target!r}"
        if full == ".." or full.startswith("../"):
            errors.append(f"{where} leaves the repository; state what it cites instead")
            return m.group(0)
        if full in ctx["includes"]:  # README.md, RESULTS.md ...: the page that shows it
            new = posixpath.relpath(ctx["includes"][full], page_dir or ".")
        elif full == docs or full.startswith(docs + "/"):
            if source == posixpath.join(docs, page):
                return m.group(0)  # a page's own link into docs/: MkDocs checks it
            new = posixpath.relpath(posixpath.relpath(full, docs), page_dir or ".")
        else:
            target_path = root / full
            if not target_path.exists():
                errors.append(f"{where}: {full} does not exist")
                return m.group(0)
            if target_path.is_dir():
                errors.append(f"{where}: {full} is a folder, which the site cannot show; link a file in it "
                              "or write the path as code")
                return m.group(0)
            if full.endswith(".md"):
                errors.append(f"{where}: {full} is Markdown outside docs/ that no page includes "
                              f"(add a page with '<!-- include: {full} -->')")
                return m.group(0)
            ctx["repo_files"].add(full)
            new = posixpath.relpath(posixpath.join(REPO_DIR, full), page_dir or ".")
        return f"{label}({new}{anchor}{title})"

    return _outside_code(text, one)


def _expand(page: str, ctx: dict, errors: list[str]) -> str:
    """The Markdown of docs page ``page`` with its includes expanded and its links rewritten."""
    docs = ctx["docs"]
    text = (ctx["root"] / docs / page).read_text(encoding="utf-8")
    parts, pos = [], 0
    for m in INCLUDE.finditer(text):
        parts.append(_rewrite(text[pos:m.start()], posixpath.join(docs, page), page, ctx, errors))
        name = posixpath.normpath(m.group(1))
        source = ctx["root"] / name
        if not source.is_file():
            errors.append(f"{docs}/{page}: included file {name} does not exist")
        else:
            parts.append(_rewrite(source.read_text(encoding="utf-8"), name, page, ctx, errors))
        pos = m.end()
    parts.append(_rewrite(text[pos:], posixpath.join(docs, page), page, ctx, errors))
    return "".join(parts)


# ------------------------------------------------------------------------------------------ hooks

def on_files(files, config):
    root = _repo_root(config)
    docs_dir = Path(config["docs_dir"]).resolve()
    ctx = {"root": root, "docs": docs_dir.relative_to(root).as_posix(), "repo_files": set(),
           "includes": _includes(files)}
    errors: list[str] = []
    for f in files.documentation_pages():  # every page once now, to know which files the links need
        _expand(f.src_uri, ctx, errors)
    if errors:
        raise PluginError("broken links in the docs:\n  " + "\n  ".join(sorted(set(errors))))
    for name in sorted(ctx["repo_files"]):
        files.append(File.generated(config, f"{REPO_DIR}/{name}", abs_src_path=str(root / name)))
    _state["ctx"] = ctx
    return files


def on_page_markdown(markdown, page, config, files):
    ctx = _state["ctx"]
    errors: list[str] = []
    markdown = _expand(page.file.src_uri, ctx, errors)
    if errors:
        raise PluginError("\n".join(errors))
    return GENERATED.sub(lambda m: _generate(m.group(1), page.file.src_uri), markdown)


def on_page_content(html, page, config, files):
    # docstrings cite with Sphinx roles (:func:`gae`); mkdocstrings renders them as ":func:<code>gae</code>"
    return re.sub(r":(?:mod|func|meth|class|data|attr|exc|obj):(?=<code>)", "", html)


def _generate(what: str, page: str) -> str:
    if what == "config-reference":
        return config_reference()
    if what == "cli-reference":
        return cli_reference()
    raise PluginError(f"docs/{page}: unknown generated block {what!r}")


# ------------------------------------------------------------------------------ config reference

def _field_docs(source: str) -> dict[str, tuple[str, dict[str, tuple[str, str]]]]:
    """Class name -> (class docstring, {field: (annotation, docstring)}) for the classes of ``source``:
    a field's docstring is the string literal right after it, as dataclass fields are documented."""
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, str]] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    doc = nxt.value.value
                fields[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
        out[node.name] = (ast.get_docstring(node) or "", fields)
    return out


def _prose(doc: str) -> str:
    """A docstring as one Markdown paragraph: reST roles and ``literals`` to code spans."""
    text = " ".join(line.strip() for line in doc.strip().splitlines())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value) -> str:
    import yaml

    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, float):
        return f"`{value!r}`"
    return f"`{yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix('...').strip()}`"


def config_reference() -> str:
    """Every key of a run config, one table per section, from ``marft/run/config.py``."""
    import marft.run.config as C

    docs = _field_docs(Path(C.__file__).read_text(encoding="utf-8"))
    lines: list[str] = []

    def table(cls, prefix: str, nested: list) -> None:
        _, fields = docs[cls.__name__]
        lines.extend(["| key | type | default | what |", "|---|---|---|---|"])
        instance = cls()
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            annotation, doc = fields.get(f.name, ("", ""))
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                nested.append((type(value), key))
                doc = _prose(doc or docs[type(value).__name__][0] or "")
                lines.append(f"| `{key}` | section | | {_cell(doc)} (keys: [`{key}.*`](#{_anchor(key)})) |")
                continue
            doc = _prose(doc)
            item = _list_item(cls, f.name, C)
            if item is not None:
                nested.append((item, f"{key}.N."))
                doc = f"{doc} (each entry: [`{key}.N.*`](#{_anchor(key + '.N')}))".strip()
            lines.append(f"| `{key}` | `{_cell(annotation)}` | {_cell(_default(value))} | {_cell(doc)} |")
        lines.append("")

    def section(cls, key: str, title: str) -> None:
        lines.extend([f"## `{title}` {{#{_anchor(key)}}}", ""])
        doc = docs[cls.__name__][0]
        if doc:
            lines.extend([_prose(doc), ""])
        nested: list = []
        table(cls, key if key.endswith(".") else f"{key}.", nested)
        for sub, sub_key in nested:
            if sub_key.endswith(".N."):
                lines.extend([f"### `{sub_key[:-1]}` {{#{_anchor(sub_key[:-1])}}}", "",
                              f"Each entry of the list `{sub_key[:-3]}` holds these keys "
                              f"(on the command line `{sub_key}<key>=...`, N counting from 0).", ""])
                table(sub, sub_key, [])
            else:
                lines.extend([f"### `{sub_key}` {{#{_anchor(sub_key)}}}", ""])
                table(sub, f"{sub_key}.", [])

    top_docs = docs["RunConfig"][1]
    scalars = [f for f in dataclasses.fields(C.RunConfig)
               if not dataclasses.is_dataclass(getattr(C.RunConfig(), f.name)) and _list_item(C.RunConfig, f.name, C) is None]
    lines.extend(["## Top-level keys {#top-level}", "", "| key | type | default | what |", "|---|---|---|---|"])
    for f in scalars:
        annotation, doc = top_docs.get(f.name, ("", ""))
        lines.append(f"| `{f.name}` | `{_cell(annotation)}` | {_cell(_default(getattr(C.RunConfig(), f.name)))} "
                     f"| {_cell(_prose(doc))} |")
    lines.append("")
    for f in dataclasses.fields(C.RunConfig):
        value = getattr(C.RunConfig(), f.name)
        if dataclasses.is_dataclass(value):
            section(type(value), f.name, f"{f.name}:")
        elif _list_item(C.RunConfig, f.name, C) is not None:
            item = _list_item(C.RunConfig, f.name, C)
            annotation, doc = top_docs[f.name]
            lines.extend([f"## `{f.name}:` {{#{_anchor(f.name)}}}", "", "| key | type | default | what |", "|---|---|---|---|",
                          f"| `{f.name}` | `{_cell(annotation)}` | {_cell(_default(value))} | {_cell(_prose(doc))} |", "",
                          f"Each entry holds the keys of `{_section_of(item, C)}:` "
                          f"([above](#{_anchor(_section_of(item, C))})).", ""])
    return "\n".join(lines)


def _anchor(key: str) -> str:
    """A heading's id for a dotted key: ``rollout.vllm`` -> ``rollout-vllm``."""
    return key.lower().replace(".", "-")


def _list_item(cls, name: str, module):
    """The dataclass of a ``list[SomeConfig]`` field of ``cls``, else None."""
    import typing

    hint = typing.get_type_hints(cls, vars(module)).get(name)
    if typing.get_origin(hint) is list:
        (arg,) = typing.get_args(hint)
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _section_of(item_cls, module) -> str:
    for f in dataclasses.fields(module.RunConfig):
        if type(getattr(module.RunConfig(), f.name)) is item_cls:
            return f.name
    return item_cls.__name__


# --------------------------------------------------------------------------------- CLI reference

def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def cli_reference() -> str:
    """Every ``marft`` command's help, from the parser of ``marft/cli.py``."""
    import argparse

    from marft import cli

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: the same page everywhere
    try:
        parser = cli._parser()
        lines = ["## `marft` {#marft}", "", "```text", parser.format_help().rstrip(), "```", ""]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        for name, p in sub.choices.items():
            lines.extend([f"## `marft {name}` {{#{name}}}", "", f"{_sentence(helps.get(name) or '')}", "",
                          "```text", p.format_help().rstrip(), "```", ""])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)
