"""marft beside TRL: the same GRPO work, one optimiser step at a time, speed and memory.

    bash scripts/setup.sh --trl                      # once: .venv-trl, the same marft with TRL 1.16.0
    .venv/bin/python benchmarks/vs_trl.py --json results/vs_trl/speed_8_steps.json   # 8 steps each, marft first
    .venv/bin/python benchmarks/vs_trl.py --steps 12 --order trl,marft,trl-defaults
    .venv/bin/python benchmarks/vs_trl.py --steps 40 --eval 256 --seed 0 --json results/vs_trl/seed0.json
    .venv/bin/python benchmarks/vs_trl.py --table results/vs_trl/seed*.json   # those runs over seeds

One agent (``team.preset=solo``) on the main job's task (reasoning-gym one-digit addition) and
model (the embedded SmolLM2-135M-Instruct, the dtype marft picks on this machine), LoRA r 8 / alpha
16 on q_proj and v_proj. Each step: ``--problems`` problems x ``--group`` samples (32 replies), up
to ``--max-new-tokens`` tokens each at temperature 0.7, rewarded by the task's own grading, then one
optimiser step over all of them (micro-batches of 8 replies), no KL term (so no reference pass),
entropy bonus 0.01, one pass over the batch (so neither side needs a separate pass for the old
log-probabilities). The prompts are the same text on both sides: marft's chat for the solver,
rendered with the tokenizer's chat template and handed to TRL as plain text.

The sides: ``marft``; ``trl``, TRL's ``GRPOTrainer`` doing the same algorithm's work (the model in
the dtype marft loads it in, adapters in float32 as peft makes them, no autocast, no gradient
checkpointing; how each computes it differs: marft skips padding, runs a shared prompt prefix once
and drops finished rows); ``trl-defaults``, the same with TRL's default gradient checkpointing (less
activation memory for a second forward pass in the backward), TRL's other default, bf16 autocast,
still off (the model is in bf16 already). Memory is each process's peak resident set, all of it
(the TRL process also imports trl and datasets).

Each side runs in a process of its own (``.venv`` for marft, ``.venv-trl`` for TRL, both with the
same torch, transformers and peft), with the same number of torch threads; this script starts them
one after the other and prints, per side: seconds per step (median of the steps after the first,
which warms up), generated tokens per step and per second, the mean reward, and the process's peak
resident memory. The losses differ (marft's GRPO is action-level: one ratio per reply; TRL's default
``dapo`` is token-level) but their cost is the same handful of elementwise operations; what is
compared is sampling 32 replies and one forward + backward over them.

``--eval N``: each side also saves its trained adapter (PEFT's format: TRL's loads into marft like
any other) and marft's evaluation scores each, and the untrained model, on the same N held-out
problems (``eval.*`` of the main job's config: temperature 0.6, seed 1234), with a 95% interval.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VENVS = {"marft": ROOT / ".venv/bin/python", "trl": ROOT / ".venv-trl/bin/python",
         "trl-defaults": ROOT / ".venv-trl/bin/python"}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def marft_config(a: argparse.Namespace):
    from marft.run.config import load_config

    return load_config(str(ROOT / "configs/duo_arithmetic.yaml"), [
        "team.preset=solo", "team.max_new_tokens={}", "train.algorithm=grpo",
        f"train.group_size={a.group}", f"rollout.episodes={a.problems * a.group}",
        f"train.minibatch_size={a.problems * a.group}", f"train.micro_batch_size={a.micro}",
        f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.temperature=0.7", "train.lr=5e-4",
        "train.entropy_coef=0.01", "train.kl_coef=0", "train.epochs=1", "train.eval_every=0",
        f"threads={a.threads}", f"seed={a.seed}", "output_dir=/tmp/marft-bench-vs-trl"])


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_marft(a: argparse.Namespace) -> dict:
    import torch

    from marft.api import prepare
    from marft.assemble import build_trainer

    cfg = marft_config(a)
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    steps = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        m = tr.iteration_step()
        steps.append({"seconds": time.perf_counter() - t0, "tokens": int(m["tokens"]),
                      "reward": float(m["reward"]),
                      "generation_s": float(m["generation_s"])})
    dtype = str(next(tr._base().parameters()).dtype).replace("torch.", "")
    if a.save:
        tr.models.save_adapters(a.save)
    return {"steps": steps, "dtype": dtype, "threads": torch.get_num_threads()}


def solo_prompts(a: argparse.Namespace, n: int):
    """``n`` training problems: the solver's chat rendered as marft renders it, and its seed."""
    from marft.run.assemble import env_factory
    from marft.engines.generation import render_chat
    from marft.engines.models import resolve_model
    from marft.team import agent_messages, build_team
    from transformers import AutoTokenizer

    cfg = marft_config(a)
    team = build_team(cfg.team)
    make_env = env_factory(cfg, team)
    tok = AutoTokenizer.from_pretrained(resolve_model(cfg.model.name, cfg.model.cache_dir))
    agent = team.agents[0]
    rows = []
    for seed in range(n):
        env = make_env()
        env.reset(seed=seed, options={"split": "train"})
        rows.append({"prompt": render_chat(tok, agent_messages(agent, env.observe(agent.name), {})), "seed": seed})
    return cfg, team, make_env, rows


def run_trl(a: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from marft.engines.models import pick_device, pick_dtype, resolve_model

    torch.set_num_threads(a.threads)
    cfg, team, make_env, rows = solo_prompts(a, 2 * a.steps * a.problems)
    name = team.agents[0].name
    source = resolve_model(cfg.model.name, cfg.model.cache_dir)
    dtype = pick_dtype(cfg.model.dtype, pick_device(cfg.model.device))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(source)

    def reward(prompts, completions, seed, **_):
        out = []
        for text, s in zip(completions, seed):
            env = make_env()
            env.reset(seed=int(s), options={"split": "train"})
            env.step(text)
            out.append(float(env.rewards.get(name, 0.0)))
        return out

    batch = a.problems * a.group
    args = GRPOConfig(
        output_dir="/tmp/marft-bench-vs-trl-trl", max_steps=a.steps, learning_rate=5e-4, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.5, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=batch // a.micro, num_generations=a.group, max_completion_length=a.max_new_tokens,
        temperature=0.7, beta=0.0, num_iterations=1, entropy_coef=0.01, logging_steps=1, report_to="none",
        gradient_checkpointing=a.side == "trl-defaults",
        save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=False, seed=a.seed, dataloader_num_workers=0)
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def __init__(self):
            self.t = None

        def on_step_begin(self, *_, **__):
            if self.t is None:
                self.t = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            steps.append({"seconds": now - self.t})
            self.t = now

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["tokens"] = int(round(logs["completions/mean_length"] * batch))
                steps[-1]["reward"] = float(logs.get("reward", float("nan")))

    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA["target_modules"],
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, peft_config=lora, callbacks=[Clock()])
    trainer.train()
    if a.save:
        trainer.model.save_pretrained(str(Path(a.save) / name))
    base = trainer.model.get_base_model().get_input_embeddings().weight.dtype  # as TRL ran it
    return {"steps": steps, "dtype": str(base).replace("torch.", ""), "threads": torch.get_num_threads()}


def held_out(a: argparse.Namespace, adapters: dict[str, Path]) -> dict:
    """marft's evaluation of the untrained model and of each side's saved adapter, in this process."""
    from marft.api import evaluate

    cfg = marft_config(a)
    cfg.eval.problems, cfg.eval.samples, cfg.eval.ablate = a.eval, 1, False
    out = {}
    for label, folder in [("untrained", None), *adapters.items()]:
        r = evaluate(cfg, adapters=folder)
        out[label] = {"accuracy": r["accuracy"], "ci95": list(r["ci95"])}
    return out


def table(files: list[str]) -> None:
    """Held-out accuracy over the seeds of ``--eval`` runs: each side's per seed, mean and 95%
    interval over seeds, and the difference of the first two sides (Welch)."""
    from marft.maths.stats import seed_interval, welch_interval

    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        sys.exit(f"vs_trl --table: {missing[0]} does not exist; give the --json files of runs with --eval N")
    try:
        runs = [json.loads(Path(f).read_text()) for f in files]
    except ValueError as e:
        sys.exit(f"vs_trl --table: a file is not a vs_trl JSON result ({e}); give the --json files of runs with --eval N")
    runs = [r for r in runs if r.get("held_out")]
    if not runs:
        sys.exit("vs_trl --table: none of these files has held-out scores (runs with --eval N)")
    labels = list(runs[0]["held_out"])
    acc = {k: [r["held_out"][k]["accuracy"] for r in runs if k in r["held_out"]] for k in labels}
    seconds = {k: [next(x for x in r["rows"] if x["side"] == k)["seconds"] for r in runs] for k in labels if k != "untrained"}
    print(f"# held-out accuracy, {len(runs)} seeds ({', '.join(files)})")
    print("| | per seed, % | mean % | 95% interval over seeds | seconds per step (median, per seed) |")
    print("|---|---|---|---|---|")
    for k in labels:
        ci = seed_interval(acc[k])
        span = f"{100 * ci[0]:.1f}-{100 * ci[1]:.1f}" if ci else "-"
        sec = " / ".join(f"{x:.2f}" for x in seconds.get(k, []))
        print(f"| {k} | {' / '.join(f'{100 * x:.1f}' for x in acc[k])} | {100 * statistics.fmean(acc[k]):.1f} | {span} | {sec or '-'} |")
    trained = [k for k in labels if k != "untrained"]
    if len(trained) >= 2:
        a, b = trained[:2]
        d = welch_interval(acc[a], acc[b])
        diff = 100 * (statistics.fmean(acc[a]) - statistics.fmean(acc[b]))
        print(f"{a} - {b}: {diff:+.1f} points" + (f" (Welch 95% interval {100 * d[0]:+.1f} to {100 * d[1]:+.1f})" if d else ""))


def summary(side: str, r: dict) -> dict:
    later = r["steps"][1:] or r["steps"]
    sec = statistics.median(s["seconds"] for s in later)
    tokens = statistics.mean(s.get("tokens", 0) for s in later)
    tps = sum(s.get("tokens", 0) for s in later) / sum(s["seconds"] for s in later)
    reward = statistics.mean(s.get("reward", float("nan")) for s in r["steps"])
    return {"side": side, "seconds": sec, "tokens": tokens, "tokens_per_s": tps, "reward": reward,
            "rss_gib": r["rss_gib"], "first_s": r["steps"][0]["seconds"], "setup_s": r["setup_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--problems", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--micro", type=int, default=8, help="replies per forward/backward pass")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", default="marft,trl")
    p.add_argument("--json", help="also write both sides' figures to this file")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="also score each side's trained adapter (and the untrained model) on N held-out problems")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print held-out accuracy over seeds from --json files of --eval runs")
    p.add_argument("--save", help=argparse.SUPPRESS)  # a child: save the trained adapter under this folder
    p.add_argument("--side", choices=sorted(VENVS), help=argparse.SUPPRESS)  # a child: one side, JSON to --out
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.table:
        return table(a.table)
    if (a.problems * a.group) % a.micro:
        p.error(f"--micro ({a.micro}) must divide --problems x --group ({a.problems * a.group})")
    if a.side:
        t0 = time.perf_counter()
        r = (run_marft if a.side == "marft" else run_trl)(a)
        r["rss_gib"] = peak_rss_gib()
        r["setup_s"] = time.perf_counter() - t0 - sum(s["seconds"] for s in r["steps"])
        Path(a.out).write_text(json.dumps(r))
        return
    sides = [s.strip() for s in a.order.split(",") if s.strip()]
    for s in sides:
        if s not in VENVS:
            p.error(f"--order: unknown side {s!r}; give marft, trl or trl-defaults, comma-separated")
        if not VENVS[s].exists():
            p.error(f"{VENVS[s]} is missing: run `bash scripts/setup.sh --trl` first")
    from common import cpu_name

    rows, raw = [], {}
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
              if k in ("steps", "problems", "group", "micro", "max_new_tokens", "threads", "seed")]
    with tempfile.TemporaryDirectory() as tmp:
        for s in sides:
            out = Path(tmp) / f"{s}.json"
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
            save = ["--save", str(Path(tmp) / s)] if a.eval else []
            done = subprocess.run([str(VENVS[s]), __file__, "--side", s, "--out", str(out), *save, *passed], env=env)
            if done.returncode or not out.exists():
                sys.exit(f"vs_trl: the {s} side failed (exit status {done.returncode}); its output is above")
            raw[s] = json.loads(out.read_text())
            rows.append(summary(s, raw[s]))
        scores = held_out(a, {s: Path(tmp) / s for s in sides}) if a.eval else {}
    first = raw[sides[0]]
    print(f"\n# {cpu_name()}, {first['threads']} threads, model dtype {first['dtype']}; {a.steps} steps of "
          f"{a.problems} problems x {a.group} samples, <= {a.max_new_tokens} new tokens, micro-batches of {a.micro}")
    print("| | dtype | seconds per step | generated tokens per step | generated tokens/s | mean reward | peak memory (RSS) | first step | start-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {raw[r['side']]['dtype']} | {r['seconds']:.2f} | {r['tokens']:.0f} | {r['tokens_per_s']:.0f} | {r['reward']:.3f} | "
              f"{r['rss_gib']:.2f} GiB | {r['first_s']:.1f} s | {r['setup_s']:.1f} s |")
    x = next((r for r in rows if r["side"] == "marft"), rows[0])
    for y in (r for r in rows if r is not x):
        print(f"{x['side']} / {y['side']}: seconds per step {y['seconds'] / x['seconds']:.2f}x faster, "
              f"tokens/s {x['tokens_per_s'] / y['tokens_per_s']:.2f}x, memory {x['rss_gib'] / y['rss_gib']:.2f}x")
    if scores:
        print(f"\n# held out: {a.eval} problems, marft's evaluation (temperature 0.6), after {a.steps} steps")
        print("| | accuracy | 95% interval |")
        print("|---|---|---|")
        for label, r in scores.items():
            print(f"| {label} | {100 * r['accuracy']:.1f}% | {100 * r['ci95'][0]:.1f}-{100 * r['ci95'][1]:.1f}% |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "raw": raw, "cpu": cpu_name(), "held_out": scores}, indent=1))


if __name__ == "__main__":
    main()
