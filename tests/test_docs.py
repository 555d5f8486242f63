"""The docs site (mkdocs.yml, docs/, scripts/docs_hooks.py) builds in strict mode, its references are
generated from the code, links to repository files are checked, and README.md stays a front door."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "scripts" / "docs_hooks.py"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True, env=env,
                          timeout=600)


def config_keys(cls, prefix: str = "") -> list[str]:
    """Every leaf key of a config dataclass, dotted (``rollout.vllm.kv_cache_gb``)."""
    out = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            out += config_keys(type(value), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_site_builds_strictly_with_references_from_the_code(tmp_path):
    from marft.run.config import AgentConfig, RunConfig

    p = build(ROOT / "mkdocs.yml", tmp_path / "site")
    out = p.stdout + p.stderr
    problems = [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert p.returncode == 0 and not problems, out[-6000:]
    site = tmp_path / "site"
    config_page = (site / "reference" / "config" / "index.html").read_text()
    keys = config_keys(RunConfig) + [f"team.agents.N.{k}" for k in config_keys(AgentConfig)]
    missing = [k for k in keys if f"<code>{k}</code>" not in config_page]
    assert not missing, f"config keys missing from the generated reference: {missing}"
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("train", "eval", "sweep", "report", "serve", "env-check"):
        assert f"marft {command}" in cli_page
    assert "usage: marft train" in cli_page and "--resume RUN_DIR" in cli_page
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "MarftTrainer" in api_page and "load_team" in api_page and "ppo_policy_loss" in api_page
    # README.md is the home page, its links rebased; a repository file it links is in the site
    home = (site / "index.html").read_text()
    assert 'href="getting-started/"' in home and 'href="_repo/configs/coop_duo_sum.yaml"' in home
    assert (site / "_repo" / "configs" / "coop_duo_sum.yaml").read_bytes() == (ROOT / "configs" / "coop_duo_sum.yaml").read_bytes()
    assert "Teams that must cooperate" in (site / "project" / "results" / "index.html").read_text()  # RESULTS.md


@pytest.mark.parametrize("link, message", [
    ("../configs/missing.yaml", "configs/missing.yaml does not exist"),
    ("../configs", "configs is a folder"),
    ("../../elsewhere/notes.md", "leaves the repository"),
])
def test_a_broken_link_to_a_repository_file_fails_the_build(tmp_path, link, message):
    (tmp_path / "docs").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("seed: 0\n")
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\n[good](../configs/run.yaml) [bad]({link})\n")
    (tmp_path / "mkdocs.yml").write_text(f"site_name: t\ndocs_dir: docs\nhooks: [{HOOKS}]\n")
    p = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0 and message in p.stdout + p.stderr
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[good](../configs/run.yaml)\n")
    p = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "_repo" / "configs" / "run.yaml").read_text() == "seed: 0\n"


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    setup_and_train = "bash scripts/setup.sh && .venv/bin/marft train configs/coop_duo_sum.yaml"
    tests = "bash scripts/setup.sh --vllm && .venv/bin/python -m pytest -n auto --dist loadgroup && .venv-vllm/bin/python -m pytest -m vllm"
    assert f"```bash\n{setup_and_train}\n```" in readme and f"```bash\n{tests}\n```" in readme
    assert tests in (ROOT / ".ci" / "run").read_text()  # CI runs exactly the README's test command
    assert "95.3%" in readme and "3.1%" in readme


def test_no_shipped_code_names_a_path_outside_the_repository():
    """The package, tests, scripts, benchmarks and configs read nothing beside the checkout (the
    tests' data copies come through MARFT_TEST_DATA_DIR or MARFT_DATA_DIR, or those tests skip)."""
    files = [p for d in ("marft", "tests", "scripts", "benchmarks", "configs", ".ci") for p in sorted((ROOT / d).rglob("*"))
             if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".yml", "") and p != Path(__file__).resolve()
             and "__pycache__" not in p.parts]
    pattern = re.compile(r"\.\./shared|[\"']shared[\"']\s*/\s*[\"']data|/work/main")
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for f in files
             for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not found, "shipped files reaching outside the repository:\n" + "\n".join(found)


def test_docs_name_no_path_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "RESULTS.md", ROOT / "BENCHMARKS.md", ROOT / "mkdocs.yml",
             *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for f in files
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\.\./shared|(?<![\w.-])shared/", line)]
    assert not found, "docs citing files outside the repository (state the fact where it is used):\n" + "\n".join(found)
