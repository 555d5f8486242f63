"""model.init_adapters: a new run's adapters start from trained PEFT adapter folders (a shorter
team's roles, an SFT adapter), the others from LoRA's zero update; wrong input is one line."""
from __future__ import annotations

import pytest
import torch

from test_rollout import make, perturb
from marft.errors import UserError


@pytest.fixture(scope="module")
def saved_duo(tiny_model_dir, tmp_path_factory):
    """A duo whose adapters were moved (PEFT starts B at zero), saved as a run saves them."""
    _, team, models = make([], tiny_model_dir)
    for k, adapter in enumerate(team.adapters):
        perturb(models, adapter, seed=k)
    folder = tmp_path_factory.mktemp("duo") / "adapters"
    models.save_adapters(folder)
    return folder, {a: models.adapter_state(a) for a in team.adapters}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def started(overrides, tiny_model_dir):
    """The team's models as a new run starts them (MarftTrainer: model.init_adapters loaded)."""
    cfg, team, models = make(overrides, tiny_model_dir)
    models.init_adapters(cfg.model.init_adapters)
    return team, models


def test_a_trio_starts_from_a_duos_roles(saved_duo, tiny_model_dir):
    folder, duo = saved_duo
    team, models = started(["team.preset=trio",
                            f"model.init_adapters={{planner: {folder / 'planner'}, verifier: {folder / 'solver'}}}"],
                           tiny_model_dir)
    assert same(models.adapter_state("planner"), duo["planner"])
    assert same(models.adapter_state("verifier"), duo["solver"])  # one role's weights under another name
    fresh = models.adapter_state("solver")  # not named: LoRA's zero update (B = 0)
    assert all(not v.any() for k, v in fresh.items() if "lora_B" in k)


@pytest.mark.parametrize("init,message", [
    ("{critic: {folder}/planner}", "model.init_adapters names adapter 'critic', which the team does not have"),
    ("{planner: {folder}/nothing}", "has no adapter_config.json"),
])
def test_wrong_init_adapters_are_one_line(saved_duo, tiny_model_dir, init, message):
    folder, _ = saved_duo
    with pytest.raises(UserError, match=message):
        started([f"model.init_adapters={init.replace('{folder}', str(folder))}"], tiny_model_dir)


def test_init_adapters_of_other_lora_settings_are_refused(saved_duo, tiny_model_dir):
    folder, _ = saved_duo
    with pytest.raises(UserError, match="other LoRA settings"):
        started([f"model.init_adapters={{planner: {folder / 'planner'}}}", "model.lora.alpha=64"], tiny_model_dir)


def test_init_adapters_must_name_folders():
    from marft.run.config import load_config
    with pytest.raises(UserError, match="model.init_adapters maps adapter names to adapter folders"):
        load_config(None, ["model.init_adapters={planner: 5}"])


def test_a_run_reads_init_adapters_when_it_starts_only(saved_duo, tiny_overrides, tmp_path):
    # the run starts from them; its resume continues from its checkpoint, even with the folders gone
    import shutil

    import marft
    folder, duo = saved_duo
    copy = tmp_path / "init"
    shutil.copytree(folder, copy)
    run = tmp_path / "run"
    config = marft.load_config("configs/duo_arithmetic.yaml", [*tiny_overrides, "train.iterations=1", "eval.before=false",
                                                               "eval.ablate=false", f"model.init_adapters={{planner: {copy / 'planner'}}}",
                                                               f"output_dir={run}"])
    with marft.MarftTrainer(config, log=None) as trainer:
        assert same(trainer.models.adapter_state("planner"), duo["planner"])
        trainer.stop()
        trainer.train()
    shutil.rmtree(copy)
    with marft.MarftTrainer.resume(run, log=None) as trainer:  # would fail reading the removed folder
        assert trainer.iteration == 0
