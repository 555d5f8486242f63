"""Several tasks in one run (``tasks:``, :mod:`marft.envs.mixture`): the draw by weight and by
schedule, a mixture of one task equal to the single-task run, advantages normalised within each
task only (hand-computed), a critic state that names the task, scaled rewards, an evaluation per
task, kill and resume, the Ray path, sweeps, and bad input."""
from __future__ import annotations

import json
import random
import signal
from collections import Counter

import pytest
import torch

from marft.maths.algorithms import ALGORITHMS
from marft.api import env_factory, prepare
from marft.run.checkpoints import latest_checkpoint
from marft.cli import main
from marft.run.config import load_config
from marft.envs.mixture import MixtureEnv, MixtureFactory, draw_tasks, weight_at
from marft.errors import UserError
from marft.maths.stats import macro_interval
from marft.run.rollout import Rollout, Turn
from marft.assemble import build_trainer
from marft.run.trainer import Trainer

from conftest import VOWEL_ENV, timeless
from test_api import comparable

TWO_ENVS = VOWEL_ENV + '''

class Digit(TurnBasedEnv):
    """Reward 1 when the reply holds a digit; its problems say which number (a held-out split of 10)."""
    def new_problem(self, rng, split, index):
        n = index if index is not None else rng.randrange(100)
        return Problem(f"Say the number {n}.", n)
    def num_problems(self, split):
        return 10 if split == "test" else None
    def grade(self, problem, reply):
        return Grade(any(c.isdigit() for c in reply), True)
    def answer_instruction(self):
        return "Answer with digits."
'''


@pytest.fixture(scope="module")
def envs_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixture-envs") / "two_envs.py"
    path.write_text(TWO_ENVS)
    return path


def mixture(envs_path, vowel=3, digit=1, **extra) -> str:
    items = [f"{{kind: custom, env: '{envs_path}:Vowel', label: vowel, weight: {vowel}}}",
             f"{{kind: custom, env: '{envs_path}:Digit', label: digit, weight: {digit}, horizon: 2}}"]
    return "tasks=[" + ", ".join(items) + "]"


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "threads=1",
            "rollout.max_new_tokens=3", "rollout.episodes=8", "eval.problems=3", "rollout.temperature=1.0",
            "train.lr=1e-2", "train.minibatch_size=4", "train.micro_batch_size=2", "team.max_new_tokens={}",
            "eval.ablate=false", f"output_dir={tmp_path / 'run'}"]


@pytest.fixture(autouse=True)
def torch_threads():
    """These runs set one torch thread (threads=1); later test files must not inherit it (their
    numerics, and so their seeded runs, depend on the thread count)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def trainer_for(overrides) -> Trainer:
    cfg = load_config("configs/duo_arithmetic.yaml", overrides)
    team, models, make_env = prepare(cfg)
    return build_trainer(cfg, team, models, make_env, log=lambda m: None)


# ---------------------------------------------------------------------------- the draw
def test_a_schedule_is_read_linearly_between_its_points_and_flat_outside():
    s = {10: 1.0, 30: 0.0, 40: 0.5}
    assert [weight_at(s, i) for i in (0, 10, 20, 25, 30, 35, 40, 100)] == [1.0, 1.0, 0.5, 0.25, 0.0, 0.25, 0.5, 0.5]
    assert weight_at(2, 7) == 2.0


def test_each_draw_is_within_one_of_its_share_and_the_mix_matches_the_weights():
    labels, weights, n = ["a", "b", "c"], [3.0, 1.0, 0.5], 8
    rng, total = random.Random(0), Counter()
    for _ in range(2000):
        got = Counter(draw_tasks(labels, weights, n, rng))
        for lab, w in zip(labels, weights):  # systematic sampling: floor or ceil of n p
            share = n * w / sum(weights)
            assert int(share) <= got[lab] <= int(share) + 1
        total.update(got)
    for lab, w in zip(labels, weights):
        assert abs(total[lab] / (2000 * n) - w / sum(weights)) < 0.005
    assert draw_tasks(labels, [0.0, 1.0, 0.0], 5, rng) == ["b"] * 5
    with pytest.raises(ValueError, match="sum to 0"):
        draw_tasks(labels, [0.0, 0.0, 0.0], 5, rng)


@pytest.mark.parametrize("algorithm", ["marft", "grpo"])
def test_the_trainer_draws_the_mix_by_weight_and_schedule_from_the_seed(envs_path, base, algorithm):
    over = [*base, mixture(envs_path), f"train.algorithm={algorithm}", "train.group_size=2"]
    tr = trainer_for(over)
    counts = Counter(o["task"] for it in range(200) for _, o in tr.resets(it))
    assert abs(counts["vowel"] / sum(counts.values()) - 0.75) < 0.01
    assert tr.resets(3) == trainer_for(over).resets(3)  # the same seed, the same draw
    plain = trainer_for([*base, "task.kind=custom", f"task.env={envs_path}:Vowel", "task.options={}",
                         f"train.algorithm={algorithm}", "train.group_size=2"])
    assert [s for s, _ in tr.resets(5)] == [s for s, _ in plain.resets(5)]  # problem seeds as without a mixture
    if algorithm == "grpo":  # a group is one problem of one task
        resets = tr.resets(1)
        assert all(resets[i] == resets[i + 1] for i in range(0, len(resets), 2))
    faded = trainer_for([*base, mixture(envs_path, vowel="{0: 1, 10: 0}", digit=1)])
    shares = [sum(o["task"] == "vowel" for _, o in faded.resets(it)) / 8 for it in (0, 5, 10, 20)]
    assert shares[0] == 0.5 and 0.25 <= shares[1] <= 0.5 and shares[2] == shares[3] == 0.0


# ---------------------------------------------------------------------------- one task = today's run
def test_a_mixture_of_one_task_is_the_single_task_run(envs_path, base, tmp_path):
    """metrics of every iteration, evaluations and adapter weights alike."""
    single, mixed = tmp_path / "single", tmp_path / "mixed"
    common = [*base, "train.iterations=2"]
    assert main(["train", "configs/duo_arithmetic.yaml", *common, "task.kind=custom", f"task.env={envs_path}:Digit",
                 "task.options={}", "task.horizon=2", f"output_dir={single}"]) == 0
    assert main(["train", "configs/duo_arithmetic.yaml", *common,
                 f"tasks=[{{kind: custom, env: '{envs_path}:Digit', horizon: 2, label: digits, weight: 5}}]",
                 f"output_dir={mixed}"]) == 0
    assert comparable(mixed) == comparable(single)
    for tag in ("untrained", "final"):
        a, b = (json.loads((d / f"eval_{tag}.json").read_text()) for d in (mixed, single))
        assert "tasks" not in a and a["per_problem_success"] == b["per_problem_success"]
    wa, wb = latest_checkpoint(mixed), latest_checkpoint(single)
    files = sorted(wb.rglob("*.safetensors"))
    assert files and all(f.read_bytes() == (wa / f.relative_to(wb)).read_bytes() for f in files)


# ---------------------------------------------------------------------------- credit per task
def _rollout(tasks: list[str], agents: list[str], R: int = 1) -> Rollout:
    """One step, one row per episode for each agent; masks all on."""
    E = len(tasks)
    turns = [Turn(0, a, torch.arange(E), torch.ones(E, 1, dtype=torch.long), torch.ones(E, 1, dtype=torch.bool),
                  torch.ones(E, R, dtype=torch.long), torch.ones(E, R, dtype=torch.bool), torch.zeros(E, R),
                  torch.zeros(E, dtype=torch.bool), [""] * E, [""] * E) for a in agents]
    z = torch.zeros(E, 1)
    return Rollout(turns, z, torch.zeros(E, 1, len(agents)), torch.ones(E, 1, dtype=torch.bool), torch.ones(E, dtype=torch.long),
                   torch.zeros(E, dtype=torch.bool), torch.zeros(E, dtype=torch.bool), tasks=tasks)


def test_advantages_are_normalised_within_each_task_never_across():
    out = _rollout(["a", "a", "b", "b", "b"], ["solo"])
    adv = [torch.tensor([1.0, 3.0, 10.0, 20.0, 60.0])]
    (got,) = ALGORITHMS["marft"].normalise(out, adv)
    # by hand: a: mean 2, sample std sqrt(2); b: mean 30, sample std sqrt((400 + 100 + 900) / 2) = sqrt(700)
    want = torch.tensor([-1 / 2**0.5, 1 / 2**0.5, -20 / 700**0.5, -10 / 700**0.5, 30 / 700**0.5])
    assert torch.allclose(got, want, atol=1e-6)
    (whole,) = ALGORITHMS["marft"].normalise(_rollout([""] * 5, ["solo"]), adv)  # one task: the whole batch
    assert torch.allclose(whole, (adv[0] - adv[0].mean()) / adv[0].std(), atol=1e-6)


def test_per_agent_whitening_is_per_task_and_agent_and_token_level_too():
    out = _rollout(["a", "a", "b", "b"], ["p", "s"])
    adv = [torch.tensor([0.0, 2.0, 5.0, 9.0]), torch.tensor([1.0, 1.0, -4.0, 4.0])]
    p, s = ALGORITHMS["dr-mas"].normalise(out, adv)
    r = 1 / 2**0.5
    assert torch.allclose(p, torch.tensor([-r, r, -r, r]), atol=1e-6)
    assert torch.allclose(s, torch.tensor([0.0, 0.0, -r, r]), atol=1e-6)  # task a's solver: no spread, centred
    tok = _rollout(["a", "b"], ["solo"], R=2)
    (t,) = ALGORITHMS["marft-token"].normalise(tok, [torch.tensor([[1.0, 3.0], [100.0, 300.0]])])
    assert torch.allclose(t, torch.tensor([-r, r, -r, r]), atol=1e-6)  # each task's two tokens apart


# ---------------------------------------------------------------------------- the environment
def test_the_critic_state_names_the_task_and_rewards_are_scaled(envs_path, base):
    over = [*base, mixture(envs_path).replace("horizon: 2}", "horizon: 2, reward_scale: 0.5}")]
    cfg = load_config("configs/duo_arithmetic.yaml", over)
    make_env = env_factory(cfg, __import__("marft.team", fromlist=["build_team"]).build_team(cfg.team))
    assert isinstance(make_env, MixtureFactory) and make_env.horizons == {"vowel": 1, "digit": 2}
    env = make_env()
    assert isinstance(env, MixtureEnv)
    env.reset(seed=3, options={"split": "test", "index": 4, "task": "digit"})
    assert env.state().startswith("Task: digit\nProblem: Say the number 4.")
    assert env.observe("solver").endswith("Answer with digits.") and "Task:" not in env.observe("planner")
    env.step("ok")
    env.step("7 it is")
    assert env.rewards == {"planner": 0.5, "solver": 0.5} and env.last()[1] == 0.5 and not env.agents
    env.reset(seed=3, options={"task": "vowel"})
    assert env.state().startswith("Task: vowel\nProblem: Say a word.")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        env.reset(seed=0, options={"task": "nope"})


def test_the_macro_interval_adds_the_tasks_errors():
    a = {"accuracy": 0.5, "ci95": [0.5 - 1.96 * 0.1, 0.5 + 1.96 * 0.1]}
    b = {"accuracy": 0.2, "ci95": [0.2 - 1.96 * 0.1, 0.2 + 1.96 * 0.1]}
    lo, hi = macro_interval([a, b])
    half = 1.96 * (0.1**2 + 0.1**2) ** 0.5 / 2
    assert abs(lo - (0.35 - half)) < 1e-9 and abs(hi - (0.35 + half)) < 1e-9


# ---------------------------------------------------------------------------- a mixed run
def test_a_mixed_run_trains_and_evaluates_every_task_on_its_own_problems(envs_path, base, tmp_path):
    run = tmp_path / "mixed"
    assert main(["train", "configs/duo_arithmetic.yaml", *base, mixture(envs_path), "train.iterations=2",
                 "eval.problems=20", f"output_dir={run}"]) == 0
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(x["tasks/vowel/episodes"] + x["tasks/digit/episodes"] == 8 for x in m)
    assert all(x["tasks/vowel/episodes"] == 6 for x in m)  # 3 : 1 of 8 by systematic sampling
    final = json.loads((run / "eval_final.json").read_text())
    vowel, digit = final["tasks"]["vowel"], final["tasks"]["digit"]
    assert vowel["problems"] == 20 and digit["problems"] == 10  # the digit task holds out 10
    assert digit["distinct_problems"] == 10 and vowel["distinct_problems"] == 1  # "Say a word." every time
    assert len(digit["solved_by_turn"]) == 2 and len(vowel["solved_by_turn"]) == 1
    assert final["accuracy"] == pytest.approx((vowel["accuracy"] + digit["accuracy"]) / 2)
    assert final["problems"] == 30 and final["micro_accuracy"] == pytest.approx(
        (20 * vowel["accuracy"] + 10 * digit["accuracy"]) / 30)
    assert digit["transcripts"][0]["observation"].startswith("Task: digit\nProblem: Say the number 0.")
    saved = (run / "config.yaml").read_text()
    assert "\ntasks:" in saved and "\ntask:" not in saved
    assert main(["eval", "configs/duo_arithmetic.yaml", *base, mixture(envs_path), "eval.problems=4",
                 "--adapters", str(run), f"output_dir={tmp_path / 'ev'}"]) == 0
    again = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(again["tasks"]) == {"vowel", "digit"} and again["tasks"]["vowel"]["problems"] == 4


def test_a_killed_mixed_run_resumes_to_the_same_result(envs_path, base, tmp_path):
    from test_kill import DRIVER, marft

    (tmp_path / "driver.py").write_text(DRIVER)
    over = [*base, mixture(envs_path), "train.iterations=3", "train.save_every=1", "train.algorithm=marft"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={straight}").returncode == 0
    r = marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={killed}", driver=tmp_path / "driver.py",
              kill=["update", "2"])
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert latest_checkpoint(killed).name == "iter_000001"
    r = marft("train", "--resume", str(killed))
    assert r.returncode == 0, r.stderr[-2000:]
    assert comparable(killed) == comparable(straight)
    ca, cb = latest_checkpoint(straight), latest_checkpoint(killed)
    assert all(f.read_bytes() == (cb / f.relative_to(ca)).read_bytes() for f in ca.rglob("*.safetensors"))
    ev = lambda run: json.loads((run / "eval_final.json").read_text())  # noqa: E731
    assert ev(killed)["tasks"]["digit"]["per_problem_success"] == ev(straight)["tasks"]["digit"]["per_problem_success"]


@pytest.mark.ray
@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_ray_shards_a_mixed_batch_as_one_process_plays_it(envs_path, base, tmp_path):
    """Two rollout workers: each plays its consecutive shard of the iteration's resets (tasks
    included) with its own sampler seed; the same shards played and merged in one process give the
    same metrics, task counts included."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    from marft.distributed import shard
    from marft.distributed.parts import shard_seed
    from marft.turns import merge_rollouts
    from marft.run.rollout import play

    over = [*base, mixture(envs_path)]
    local = trainer_for(over)

    def sharded(it):
        parts = [play(local.cfg, local.team, local.engine, local.episodes.make_env, s, shard_seed(local.cfg, it, k))
                 for k, s in enumerate(shard(local.resets(it), 2))]
        out = merge_rollouts(parts, local.team.names)
        assert out.tasks == [o["task"] for _, o in local.resets(it)]  # each episode keeps its task
        return out

    local.play = sharded
    expected = [comparable_metrics(local.iteration_step()) for _ in range(2)]
    got = ray_metrics("configs/duo_arithmetic.yaml", [*over, "cluster.rollout_workers=2", f"output_dir={tmp_path / 'd'}"])
    assert got == expected and got[0]["tasks/vowel/episodes"] == 6


def comparable_metrics(m: dict) -> dict:
    return timeless(m, also=("distributed/",))


def ray_metrics(config: str, overrides: list[str], iterations: int = 2) -> list[dict]:
    """The comparable metrics of ``iterations`` iterations of a Ray trainer (Ray episodes and
    policy) on a local Ray cluster of 2 CPUs (half a CPU per worker and learner), started and shut
    down here."""
    import ray

    from marft.distributed import RayEpisodes, RayPolicy

    cfg = load_config(config, [*overrides, "cluster.worker_cpus=0.5", "cluster.learner_cpus=0.5"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        dist = build_trainer(cfg, *prepare(cfg), log=lambda m: None)
        assert isinstance(dist.episodes, RayEpisodes) and isinstance(dist.policy, RayPolicy)
        try:
            return [comparable_metrics(dist.iteration_step()) for _ in range(iterations)]
        finally:
            dist.close()
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- sweeps and bad input
def test_a_sweep_takes_mixtures_as_grid_values(envs_path, tmp_path):
    from marft.experiments.sweep import load_sweep

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""
output_dir: {tmp_path / 'out'}
base: {__import__('pathlib').Path('configs/duo_arithmetic.yaml').resolve()}
grids:
  - task:
      vowel: {{task.kind: custom, task.env: '{envs_path}:Vowel', task.options: {{}}}}
      mixed: {{tasks: [{{kind: custom, env: '{envs_path}:Vowel'}}, {{kind: custom, env: '{envs_path}:Digit', label: digit}}]}}
    seed: [0]
""")
    runs = {r.labels["task"]: r for r in load_sweep(sweep).runs}
    cfg = load_config("configs/duo_arithmetic.yaml", runs["mixed"].overrides)
    assert [t.kind for t in cfg.tasks] == ["custom", "custom"] and not load_config(
        "configs/duo_arithmetic.yaml", runs["vowel"].overrides).tasks


@pytest.mark.parametrize("tasks, message", [
    ("[{kind: custom, env: 'x.py:A', weight: -1}, {kind: custom, env: 'x.py:B', label: b}]", "tasks.0.weight must be a number, 0 or more, got -1"),
    ("[{kind: custom, env: 'x.py:A', weight: 0}, {kind: custom, env: 'x.py:B', label: b, weight: 0}]", "every task's weight is 0 at iteration 0"),
    ("[{kind: custom, env: 'x.py:A', weight: {0: 1, 5: 0}}, {kind: custom, env: 'x.py:B', label: b, weight: {0: 0, 5: 0, 10: 1}}]",
     "every task's weight is 0 at iteration 5"),
    ("[{kind: reasoning_gym}, {kind: reasoning_gym, options: {min_terms: 3}}]",
     "tasks.0 and tasks.1 are both named 'basic_arithmetic'; give each a distinct tasks.N.label"),
    ("[{kind: reasoning_gym}, {kind: poetry, label: p}]", "tasks.1.kind must be one of"),
    ("[{kind: reasoning_gym}, {kind: workflow, workflow: 'a:b', label: w}]", "tasks.1 is a workflow task, which cannot be mixed"),
    ("[{kind: reasoning_gym, weight: {x: 1}}, {kind: coop, name: sum}]", "tasks.0.weight's schedule has the key 'x'"),
    ("[{kind: reasoning_gym, reward_scale: 0}, {kind: coop, name: sum}]", "tasks.0.reward_scale must be a positive number"),
])
def test_bad_mixtures_are_one_line(tasks, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/duo_arithmetic.yaml", [f"tasks={tasks}"])


def test_a_task_whose_options_do_not_fit_its_kind_names_the_task(base, tmp_path, capsys):
    bad = "tasks=[{kind: reasoning_gym}, {kind: coop, name: sum, label: together, options: {colour: red}}]"
    assert main(["train", "configs/duo_arithmetic.yaml", *base, bad, f"output_dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "tasks.1 (together): cannot build the coop environment" in err and "colour" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_file_with_both_task_and_tasks_is_refused(tmp_path):
    f = tmp_path / "both.yaml"
    f.write_text("task: {kind: reasoning_gym}\ntasks: [{kind: coop, name: sum}, {kind: reasoning_gym}]\n")
    with pytest.raises(UserError, match="gives both task: .one task. and tasks: .a mixture.; keep one of them"):
        load_config(f)


def test_a_task_override_beside_a_files_mixture_blames_the_override(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text("tasks: [{kind: coop, name: sum}, {kind: reasoning_gym}]\n")
    with pytest.raises(UserError) as e:
        load_config(f, ["task.kind=coop"])
    assert str(e.value) == (f"config: the override task.kind=coop sets task: (one task), but {f} trains a mixture of "
                            "tasks (tasks:); change one of the mixture's tasks instead (tasks.0.kind=...), or add "
                            "tasks=[] to train the one task")
    assert "gives both" not in str(e.value)
    cfg = load_config(f, ["task.kind=coop", "task.name=sum", "tasks=[]"])  # the way out it names
    assert not cfg.tasks and (cfg.task.kind, cfg.task.name) == ("coop", "sum")
    assert load_config(f, ["tasks.0.name=lookup"]).tasks[0].name == "lookup"
    with pytest.raises(UserError, match=r"the overrides set both task: \(one task, task.kind\) and tasks: \(a mixture, tasks\)"):
        load_config(None, ["task.kind=coop", "tasks=[{kind: coop, name: sum}, {kind: reasoning_gym}]"])


def test_each_task_of_a_mixture_is_evaluated_as_it_would_be_alone(envs_path, base, tmp_path):
    """The same weights, the same problems and sampling seed: a task's result inside the mixture's
    evaluation is its result evaluated alone (episodes, replies, accuracy)."""
    from marft.api import evaluate

    over = [*base, "eval.problems=6", "rollout.episodes=4", "eval.temperature=1.0"]
    mixed = evaluate(load_config("configs/duo_arithmetic.yaml", [*over, mixture(envs_path)]))
    alone = evaluate(load_config("configs/duo_arithmetic.yaml", [*over, "task.kind=custom", f"task.env={envs_path}:Digit",
                                                                 "task.options={}", "task.horizon=2"]))
    digit = mixed["tasks"]["digit"]
    for key in ("per_problem_success", "mean_steps", "generated_tokens", "agents", "solved_by_turn"):
        assert digit[key] == alone[key], key
    assert [t["turns"] for t in digit["transcripts"]] == [t["turns"] for t in alone["transcripts"]]


class Letters(__import__("marft.envs", fromlist=["TurnBasedEnv"]).TurnBasedEnv):
    """A task given to the Python API as the class itself."""

    def new_problem(self, rng, split, index):
        from marft.envs import Problem
        return Problem("Say a letter.", None)

    def grade(self, problem, reply):
        from marft.envs import Grade
        return Grade(bool(reply.strip()), True)


def test_the_python_api_takes_classes_and_functions_in_a_mixture():
    import marft

    cfg = marft.load_config({"tasks": [{"kind": "custom", "env": Letters, "label": "letters"},
                                       {"kind": "coop", "name": "sum"}]},
                            [("tasks.1.reward", "unused.py:f")])
    assert cfg.tasks[0].env == "test_mixture:Letters" and cfg.tasks[1].reward == "unused.py:f"
    again = marft.load_config("configs/duo_arithmetic.yaml", [("tasks", [{"kind": "custom", "env": Letters},
                                                                         {"kind": "coop", "name": "sum"}])])
    assert again.tasks[0].env == "test_mixture:Letters"


def test_a_trained_mixture_team_is_told_which_tasks_instruction(envs_path, base):
    from marft.api import TrainedTeam

    team = TrainedTeam(load_config("configs/duo_arithmetic.yaml", [*base, mixture(envs_path)]))
    assert team._instruction("digit") == "Answer with digits."
    assert team._instruction("vowel") == "Give the final answer in \\boxed{}."
    with pytest.raises(UserError, match="trained on several tasks .vowel, digit.; say which one"):
        team.solve("Say 3.")
    with pytest.raises(UserError, match="unknown task 'poems'"):
        team._instruction("poems")
    scaled = TrainedTeam(load_config("configs/duo_arithmetic.yaml", [*base, "task.kind=coop", "task.name=sum",
                                                                     "task.options={}", "task.reward_scale=2"]))
    assert "boxed" in scaled._instruction()


def test_one_task_with_scaled_rewards_plays_whatever_its_weight(envs_path, base):
    cfg = load_config("configs/duo_arithmetic.yaml", [*base, "task.kind=custom", f"task.env={envs_path}:Vowel",
                                                      "task.options={}", "task.reward_scale=2", "task.weight=0"])
    make_env = env_factory(cfg, __import__("marft.team", fromlist=["build_team"]).build_team(cfg.team))
    env = make_env()
    env.reset(seed=1)
    env.step("ok")
    env.step("apple")
    assert env.rewards == {"planner": 2.0, "solver": 2.0} and env.state().startswith("Problem:")  # one task: no "Task:" line


def test_a_mixtures_interval_over_seeds_is_that_of_its_macro_mean():
    from marft.experiments.report.build import summary

    def result(a: list[float], b: list[float]) -> dict:
        ta = {"accuracy": sum(a) / len(a), "per_problem_success": a, "ci95": [0, 1]}
        tb = {"accuracy": sum(b) / len(b), "per_problem_success": b, "ci95": [0, 1]}
        return {"accuracy": (ta["accuracy"] + tb["accuracy"]) / 2, "per_problem_success": a + b, "tasks": {"a": ta, "b": tb}}

    runs = [result([1, 0, 1, 1], [0] * 20), result([1, 1, 0, 1], [0] * 19 + [1])]
    s = summary(runs)
    per_task = [summary([r["tasks"][t] for r in runs]) for t in ("a", "b")]
    assert s["mean"] == pytest.approx((0.75 + 0.025) / 2)
    assert s["ci95"] == macro_interval([{"accuracy": x["mean"], "ci95": x["ci95"]} for x in per_task])
    assert s["ci95"][0] < s["mean"] < s["ci95"][1]


@pytest.mark.parametrize("tasks, message", [
    ("[{kind: reasoning_gym, label: 'add/one'}, {kind: coop, name: sum}]", "tasks.0's name 'add/one' may hold only"),
    ("[{kind: reasoning_gym}, {kind: coop, name: sum, reward_scale: 2}]", None),
])
def test_labels_name_metrics(tasks, message):
    if message is None:
        assert load_config("configs/duo_arithmetic.yaml", [f"tasks={tasks}"]).tasks[1].reward_scale == 2
        return
    with pytest.raises(UserError, match=message):
        load_config("configs/duo_arithmetic.yaml", [f"tasks={tasks}"])


def test_a_workflow_task_does_not_scale_its_rewards():
    with pytest.raises(UserError, match="task.reward_scale is for the team's built-in tasks"):
        load_config("configs/workflow_duo.yaml", ["task.reward_scale=2"])


def test_python_dash_m_marft_cli_eval_of_a_mixture(envs_path, base, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "marft.cli", "eval", "configs/duo_arithmetic.yaml", *base, mixture(envs_path),
                        "eval.problems=2", f"output_dir={tmp_path / 'ev'}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mixture of vowel + digit" in r.stderr and set(json.loads((tmp_path / "ev" / "eval.json").read_text())["tasks"]) == {"vowel", "digit"}
