"""``model.name: tiny``: a tiny random chat model marft builds itself, offline, once per cache
(marft/engines/models.py: build_tiny_model, tiny_model), for smoke tests of marft train, eval and env-check."""
from __future__ import annotations

from pathlib import Path

import torch

from marft.cli import main
from marft.engines.models import build_tiny_model, resolve_model


def test_tiny_is_built_once_into_the_cache_and_leaves_the_random_state_alone(tmp_path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    path = Path(resolve_model("tiny", str(tmp_path / "cache")))
    assert torch.equal(torch.get_rng_state(), state)  # a run's own seeding is not disturbed by the build
    assert path == tmp_path / "cache" / "models" / "tiny-v1" and (path / "chat_template.jinja").is_file()
    same = build_tiny_model(tmp_path / "again")  # the tests' model: the same bytes
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in same.iterdir())
    assert all((path / p.name).read_bytes() == p.read_bytes() for p in same.iterdir())
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert Path(resolve_model("tiny", str(tmp_path / "cache"))) == path  # cached: not built again
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p != path]  # no half-written folder left beside it


def test_tiny_trains_and_evaluates_from_the_command_line(tmp_path, capsys):
    tiny = ["model.name=tiny", f"model.cache_dir={tmp_path / 'cache'}", "model.device=cpu", "rollout.max_new_tokens=4",
            "rollout.episodes=4", "eval.problems=2", "train.minibatch_size=4"]
    run = tmp_path / "run"
    assert main(["train", "configs/duo_arithmetic.yaml", *tiny, "train.iterations=1", f"output_dir={run}"]) == 0
    assert (run / "eval_final.json").is_file() and (run / "checkpoints" / "latest").exists()
    assert main(["eval", "configs/duo_arithmetic.yaml", *tiny, f"output_dir={tmp_path / 'ev'}", "--adapters", str(run)]) == 0
    err = capsys.readouterr().err
    assert "model tiny" in err and "Traceback" not in err
