"""Outputs that a refactor must not change, bit for bit: short tiny-model runs of every algorithm,
a mixture, an agent program (workflow), a resumed run and a Ray run (2 rollout workers, 2 learners
per adapter), each reduced to its metrics (without times and rates), its evaluations (without
times and the machine record), and the sha256 of its adapters' and critic's tensors and of its
optimisers' states.

The recorded outputs (``tests/data/unchanged.json``) were written by the code before the redesign
of issue 42 (the Intel Xeon's; the AMD EPYC's, 2026-12-07, by 058c32d, whose training code gave the
Intel record bit for bit); they are keyed by the CPU they were recorded on, because another CPU (another matrix
kernel) rounds differently and then samples other tokens: on a CPU with no record the test skips,
saying so. A deliberate change of what a run computes remakes its record where it can be made and
drops it elsewhere: ``grpo``'s whitening took its statistics over episodes instead of turns
(2026-12-07; this task's episodes end after one or two steps), recorded anew on the AMD EPYC, none
on the Intel Xeon until it is recorded there. The AMD EPYC with AVX-512 BF16's, 2026-12-08, by
c7893af (after the redesign): the same episodes, rewards and evaluations as the Intel record, the
losses, entropies and gradient norms apart from the sixth significant figure on (another matrix
kernel), so the weights' digests differ. Record them for this CPU (on the code you trust) with::

    .venv/bin/python tests/test_unchanged.py --record
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import pytest
from conftest import varies
from marft.run.checkpoints import read_critic

RECORD = Path(__file__).parent / "data" / "unchanged.json"
TASK = Path(__file__).parent / "data" / "unchanged_task.py"
BASE = ["model.name=tiny", "model.dtype=float32", "model.device=cpu", "rollout.max_new_tokens=6", "rollout.episodes=4",
        "rollout.temperature=1.0", "eval.problems=3", "eval.samples=1", "eval.ablate=false", "team.max_new_tokens={}",
        "train.iterations=2", "train.minibatch_size=2", "train.micro_batch_size=2", "train.save_every=1", "threads=1",
        "seed=3"]
ENV = ["task.kind=custom", "task.options={}", f"task.env={TASK}:Vowels", "task.horizon=2"]
GROUPED = ["train.group_size=2"]
RAY = ["cluster.rollout_workers=2", "cluster.learners_per_adapter=2", "cluster.worker_cpus=0.5", "cluster.learner_cpus=0.25"]
MIXTURE = ("tasks=[{kind: custom, env: '" + f"{TASK}" + ":Vowels', label: vowels, weight: 3}, "
           "{kind: custom, env: '" + f"{TASK}" + ":Digits', label: digits, weight: 1, horizon: 1}]")
WORKFLOW = ["task.kind=workflow", "task.options={}", f"task.workflow={TASK}:duo", f"task.reward={TASK}:reward"]
DUO = "configs/duo_arithmetic.yaml"

# name -> (config, overrides); "resumed" trains 1 iteration, then resumes to 2
RUNS: dict[str, tuple[str, list[str]]] = {
    "marft": (DUO, [*ENV, "train.algorithm=marft"]),
    "marft-ps": (DUO, [*ENV, "train.algorithm=marft", "team.share_adapter=true"]),
    "marft-token": (DUO, [*ENV, "train.algorithm=marft-token"]),
    "ippo": (DUO, [*ENV, "train.algorithm=ippo"]),
    "grpo": (DUO, [*ENV, "train.algorithm=grpo", *GROUPED]),
    "dr-mas": (DUO, [*ENV, "train.algorithm=dr-mas", *GROUPED]),
    "at-grpo": (DUO, [*ENV, "train.algorithm=at-grpo", *GROUPED]),
    "mixture": (DUO, [MIXTURE, "train.algorithm=marft"]),
    "workflow": ("configs/workflow_duo.yaml", [*WORKFLOW, "train.algorithm=marft"]),
    "resumed": (DUO, [*ENV, "train.algorithm=marft", "train.eval_every=1"]),
    "ray": (DUO, [*ENV, "train.algorithm=marft", *RAY]),
}
SLOW = {"ray"}  # Ray's start-up alone is half a minute on two cores: marked slow, run by the record


def _timeless(d: dict) -> dict:
    """A metrics line or an evaluation without what depends on the clock or the machine."""
    drop = ("seconds", "machine", "tokens_per_s", "adapters")
    out = {}
    for k, v in d.items():
        if k in drop or "per_s" in k or varies(k):
            continue
        out[k] = _timeless(v) if isinstance(v, dict) else v
    return out


def _tensor_digest(obj, h) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        h.update(str((obj.dtype, tuple(obj.shape))).encode())
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _tensor_digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensor_digest(x, h)
    else:
        h.update(repr(obj).encode())


def summarise(run_dir: Path) -> dict:
    """What the run wrote, reduced to what must not change."""
    import torch

    run_dir = Path(run_dir)
    metrics = [_timeless(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {p.stem: hashlib.sha256(json.dumps(_timeless(json.loads(p.read_text())), sort_keys=True).encode()).hexdigest()
             for p in sorted(run_dir.glob("eval_*.json"))}
    ckpts = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("iter_*")):
        adapters = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in sorted((ckpt / "adapters").rglob("*.safetensors"))}
        state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
        critic = read_critic(ckpt)  # the heads: the checkpoint's critic/ folder (in trainer.pt before it had one)
        state["heads"] = critic[1] if critic else state.get("heads", {})
        parts = {}
        for key in ("heads", "critic_opt", "policy_opt", "torch_rng", "iteration", "bad_in_a_row"):
            h = hashlib.sha256()
            _tensor_digest(state.get(key), h)
            parts[key] = h.hexdigest()
        ckpts[ckpt.name] = {"adapters": adapters, "trainer": parts}
    return {"metrics": metrics, "evaluations": evals, "checkpoints": ckpts}


def train(name: str, run_dir: Path) -> dict:
    """Run ``name`` of :data:`RUNS` into ``run_dir`` (through the Python API) and summarise it."""
    import marft

    config, extra = RUNS[name]
    over = [*BASE, *extra, f"output_dir={run_dir}"]
    quiet = {"log": None}
    if name == "resumed":
        with marft.MarftTrainer(marft.load_config(config, [*over, "train.iterations=1"]), **quiet) as t:
            t.train()
        with marft.MarftTrainer.resume(run_dir, ["train.iterations=2"], **quiet) as t:
            t.train()
    else:
        with marft.MarftTrainer(marft.load_config(config, over), **quiet) as t:
            t.train()
    return summarise(run_dir)


def cpu_key() -> str:
    """The CPU the outputs depend on: its model name and whether it has AMX / AVX-512 BF16."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    kinds = [f for f in ("amx_bf16", "avx512_bf16", "avx512f") if f" {f}" in flags]
    return f"{name} [{' '.join(kinds)}] threads=1"


# the sizes of what a Ray run pickles (distributed/bytes_*) count the module paths of the classes
# pickled (marft.learner.PolicyBatch became marft.run.learner.PolicyBatch) and vary by a few bytes
# with pickle's memo from one process to another: not behaviour, left out
def _unpickled(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("distributed/bytes_")} for m in metrics]


def _as_recorded(got: list[dict], want: list[dict]) -> list[dict]:
    """The metrics lines as the record has them: metrics added since (critic quality, asynchronous
    training's) are new outputs, not changed ones; a recorded metric that is missing stays missing."""
    return [{k: g[k] for k in w if k in g} for g, w in zip(got, want)] + got[len(want):]


def _recorded() -> dict:
    if not RECORD.is_file():
        return {}
    return json.loads(RECORD.read_text()).get(cpu_key(), {})


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in RUNS])
def test_the_outputs_are_those_recorded_before_the_redesign(name, tmp_path, monkeypatch):
    recorded = _recorded()
    if name not in recorded:
        pytest.skip(f"no outputs of {name} recorded for this CPU ({cpu_key()}); record them on trusted code with "
                    f"python tests/test_unchanged.py --record {name}")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    got = train(name, tmp_path / "run")
    want = recorded[name]
    assert _unpickled(_as_recorded(got["metrics"], want["metrics"])) == _unpickled(want["metrics"])
    # an evaluation added since is a new output, not a changed one: a resumed run now makes the
    # evaluation its checkpoint's iteration was owed (eval_iter_000001 here: the first attempt ended
    # at iteration 1 with its final one, which a run extended to 2 iterations sets aside)
    assert {k: got["evaluations"].get(k) for k in want["evaluations"]} == want["evaluations"]
    assert set(got["evaluations"]) - set(want["evaluations"]) <= ({"eval_iter_000001"} if name == "resumed" else set())
    assert got["checkpoints"] == want["checkpoints"]


def test_staleness_zero_is_the_synchronous_run(tmp_path, monkeypatch):
    """``train.max_staleness: 0`` (asynchronous training off), whatever the other asynchronous
    settings say, is the synchronous run recorded before asynchronous training existed."""
    recorded = _recorded()
    if "marft" not in recorded:
        pytest.skip(f"no outputs recorded for this CPU ({cpu_key()})")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    RUNS["marft-staleness-0"] = (DUO, [*RUNS["marft"][1], "train.max_staleness=0", "train.async_mode=streaming",
                                       "train.async_chunk=2"])
    try:
        got = train("marft-staleness-0", tmp_path / "run")
    finally:
        del RUNS["marft-staleness-0"]
    want = recorded["marft"]
    assert _as_recorded(got["metrics"], want["metrics"]) == want["metrics"]
    assert (got["evaluations"], got["checkpoints"]) == (want["evaluations"], want["checkpoints"])


if __name__ == "__main__":  # python tests/test_unchanged.py --record [NAME ...]
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.chdir(Path(__file__).resolve().parents[1])
    sys.path.insert(0, str(Path.cwd()))
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(RUNS)
    data = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    mine = data.setdefault(cpu_key(), {})
    for n in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = train(n, Path(tmp) / "run")
        if "--record" in sys.argv:
            mine[n] = out
        elif n not in mine or (_unpickled(mine[n]["metrics"]), mine[n]["evaluations"], mine[n]["checkpoints"]) != (
                _unpickled(_as_recorded(out["metrics"], mine[n]["metrics"])), out["evaluations"], out["checkpoints"]):
            print(f"{n}: DIFFERS from the record")
        else:
            print(f"{n}: same as recorded")
        print(n, "done", flush=True)
    if "--record" in sys.argv:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
