"""The package's layout holds (docs/project/developers.md): no module imports another module's
private name, and each floor imports only the floors its package docstring allows. Read from the
code's imports (those inside functions too), nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "marft"

# what each part of the package may import (the docstrings of the subpackages say the same);
# "-" is the ground floor's modules: errors, team, turns
MAY_IMPORT = {
    "-": {"-"},
    "engines": {"-", "engines"},
    "maths": {"-", "engines", "maths"},
    "envs": {"-", "envs"},
    "serving": {"-", "engines", "envs", "serving"},
    "run": {"-", "engines", "maths", "envs", "serving", "run"},
    "distributed": {"-", "engines", "maths", "envs", "serving", "run", "distributed"},
    "experiments": {"-", "engines", "maths", "envs", "serving", "run", "experiments"},
    "assemble": {"-", "engines", "maths", "envs", "serving", "run", "distributed"},
}
FRONT_DOORS = {"api", "cli", "train_cli", "__init__"}  # may import anything
GROUND = {"errors", "team", "turns"}


def _modules() -> list[tuple[Path, str]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out.append((f, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return out


def _imports(path: Path, module: str):
    """(line, imported module, imported name or None) of every ``from marft... import`` in ``path``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and node.module.split(".")[0] == "marft":
            target = node.module
        else:
            continue
        for alias in node.names:
            yield node.lineno, target, alias.name


def _part(module: str) -> str:
    """The floor a module belongs to: its subpackage, a front door or the ground ("-")."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "-" if parts[1] in GROUND else parts[1]


def test_no_module_imports_another_modules_private_name():
    found = []
    for path, module in _modules():
        for line, target, name in _imports(path, module):
            if not name.startswith("_") or name.startswith("__"):
                continue
            # a private module of the same package (envs/_code_checker.py) is the package's own business
            same_package = target.rsplit(".", 1)[0] == module.rsplit(".", 1)[0] or target == module.rsplit(".", 1)[0]
            if (PACKAGE.parent / (target.replace(".", "/") + "/" + name + ".py")).is_file() and same_package:
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target}.{name}")
    assert not found, "private names imported across modules (give them a public name):\n" + "\n".join(found)


def test_each_floor_imports_only_what_it_may():
    found = []
    for path, module in _modules():
        here = _part(module)
        if here in FRONT_DOORS:
            continue
        for line, target, name in _imports(path, module):
            there = _part(target if target != "marft" else f"marft.{name}")
            if there not in MAY_IMPORT[here]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {here} imports {target} ({there})")
    assert not found, "imports that run against the floors (docs/project/developers.md):\n" + "\n".join(found)


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()))
def test_every_subpackage_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    assert len(doc) > 100 and "import" in doc, f"marft/{package}/__init__.py: a docstring saying what lives there and what it may import"


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """A private import and an import against the floors, planted in a copy, are both found."""
    import shutil

    copy = tmp_path / "marft"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "engines" / "planted.py").write_text("from ..run.trainer import Trainer\nfrom .generation import _sample\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    with pytest.raises(AssertionError, match="planted.py:2: marft.engines.generation._sample"):
        test_no_module_imports_another_modules_private_name()
    with pytest.raises(AssertionError, match="planted.py:1: engines imports marft.run.trainer"):
        test_each_floor_imports_only_what_it_may()
