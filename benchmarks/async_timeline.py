"""Synchronous against asynchronous training on GPUs: a timeline MODEL, not a measurement.

    .venv/bin/python benchmarks/async_timeline.py     # prints the table, writes results/async_timeline.txt
    .venv/bin/python benchmarks/async_timeline.py --handover 0.5 --learner-eff 0.8 --gpus 8x8

Nothing here runs a model. The inputs are the phase times of one measured iteration (docs/gpu.md,
run 2: iteration 2 of `docs/gpu/run2_grouped_attention/metrics.jsonl`, one H200, Qwen2.5-1.5B's
shapes, the duo, 128 episodes x 256 tokens) plus the assumed parameters below; the output is arithmetic.

Phases of one iteration of 128 episodes (seconds, measured):
    gen    = generation_s                                   5.310
    env    = rollout_s - generation_s (prompts, rewards: CPU) 0.106
    blp    = behaviour_logprobs_s (learner re-scores the batch) 1.005
    learn  = learner_s (forward + backward, PPO epochs)     4.291
    critic = critic_features_s + critic_update_s             1.044
    other  = seconds - rollout_s - critic - policy_update_s  0.001 (unaccounted)
    the "rest" of the 11.757 s = seconds - gen - blp - learn = env + critic + other = 1.151.
Sides: rollout GPU work Rg = gen; learner GPU work Ug = blp + learn + critic + other
(`--critic rollout` moves critic from Ug to Rg). h = adapter hand-over, ASSUMED (not in docs/gpu.md;
run 2 ran generator and learner in one process, sharing the adapters, so its h is 0 and inside `seconds`).
Waits: each episode makes one tool/env call of w seconds, i.i.d.; Wmax(n) = E[max of n draws]
(Monte Carlo, random.Random(0), --trials trials), Wmean = E[w] (exact). Without tool calls w = 0.
S(x, eta) = 1 + (x - 1) * eta: the speed-up of x GPUs, each beyond the first adding eta of one.

Formulas (T = seconds per iteration, B = episodes per iteration, throughput = B / T):
 (a) one GPU, B = 128, h = 0:
     sync   T = Rg + env + Wmax(128) + Ug
     async  T = max(Rg + Ug - e * min(Rg, Ug), Rg + env + W)   e = overlap efficiency (0: time-sliced)
 (b)/(c) N rollout GPUs + M learner GPUs (b: N = M = 1), each rollout GPU plays 128 episodes, B = 128 N:
     rollout side  Rs = Rg * N / S(N, eta_r) + env + W      learner side  Ls = Ug * N / S(M, eta_l) + h
     sync   T = Rs + Ls;  async  T = max(Rs, Ls)
     colocated sync on all N + M GPUs (the same GPUs, each rolling out and learning), B = 128 (N + M):
            T = Rg * (N+M) / S(N+M, eta_r) + env + Wmax(B) + Ug * (N+M) / S(N+M, eta_l) + h
 W = Wmax(B) in sync rows (the batch waits for its slowest episode). In async rows W = Wmean (episodes
 enter batches as they complete; Little's law with B episodes in flight and a decode step as fast as
 at a full batch, i.e. continuous batching) when k >= k needed = ceil(Lmax / T): an episode of latency
 Lmax = Rg * N / S(N, eta_r) + env + (largest wait) is about that many adapter versions old when an
 update can use it. With a smaller k ("k = 1" rows) each batch waits for its slowest episode: W = Wmax(B).
 Speed-up = throughput / throughput of the same case's sync row (colocated rows too).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

DATE = "2026-12-06"
RUN2 = {  # docs/gpu/run2_grouped_attention/metrics.jsonl, iteration 2 (rounded to 1 ms)
    "seconds": 11.757, "rollout_s": 5.416, "generation_s": 5.310, "critic_features_s": 0.872,
    "critic_update_s": 0.172, "policy_update_s": 5.296, "behaviour_logprobs_s": 1.005, "learner_s": 4.291,
    "episodes": 128, "tokens": 65348}


def phases(m: dict, critic_on: str) -> dict:
    """gen, env, blp, learn, critic, other (module docstring) and the sides Rg, Ug."""
    p = {"gen": m["generation_s"], "env": m["rollout_s"] - m["generation_s"], "blp": m["behaviour_logprobs_s"],
         "learn": m["learner_s"], "critic": m["critic_features_s"] + m["critic_update_s"]}
    p["other"] = m["seconds"] - m["rollout_s"] - p["critic"] - m["policy_update_s"]
    p["rest"] = m["seconds"] - p["gen"] - p["blp"] - p["learn"]
    p["Rg"] = p["gen"] + (p["critic"] if critic_on == "rollout" else 0.0)
    p["Ug"] = p["blp"] + p["learn"] + p["other"] + (p["critic"] if critic_on == "learner" else 0.0)
    return p


class Waits:
    """One tool/env call per episode: with probability tail_p it takes tail_s seconds, otherwise a
    log-normal draw exp(N(ln median, sigma^2)). mean = (1 - tail_p) * median * exp(sigma^2 / 2) + tail_p * tail_s;
    emax(n) = mean over `trials` trials of the largest of n draws, random.Random(0) (one stream per n)."""

    def __init__(self, median: float, sigma: float, tail_p: float, tail_s: float, trials: int):
        self.median, self.sigma, self.tail_p, self.tail_s, self.trials = median, sigma, tail_p, tail_s, trials
        self.mean = (1 - tail_p) * median * math.exp(sigma ** 2 / 2) + tail_p * tail_s
        self.largest = tail_s if tail_p > 0 else median * math.exp(3 * sigma)  # for the latency of k needed
        self._max: dict[int, float] = {}

    def draw(self, rng: random.Random) -> float:
        return self.tail_s if rng.random() < self.tail_p else self.median * math.exp(rng.gauss(0.0, self.sigma))

    def emax(self, n: int) -> float:
        if n not in self._max:
            rng = random.Random(0)
            self._max[n] = sum(max(self.draw(rng) for _ in range(n)) for _ in range(self.trials)) / self.trials
        return self._max[n]


NO_WAITS = type("NoWaits", (), {"mean": 0.0, "largest": 0.0, "emax": lambda self, n: 0.0})()


def S(x: int, eta: float) -> float:
    """Speed-up of x GPUs: 1 + (x - 1) * eta."""
    return 1 + (x - 1) * eta


def rows(p: dict, a: argparse.Namespace, waits, label: str) -> list[dict]:
    """Every modelled row for one wait distribution (formulas in the module docstring)."""
    Rg, Ug, env, h, B0 = p["Rg"], p["Ug"], p["env"], a.handover, RUN2["episodes"]
    out = []

    def row(case, mode, B, T, bound, base=None, lmax=None, k="-"):
        r = {"case": case, "waits": label, "mode": mode, "B": B, "T": T, "eps": B / T, "bound": bound}
        r["speedup"] = r["eps"] / base["eps"] if base else 1.0
        r["k"] = max(1, math.ceil(lmax / T)) if lmax is not None else k
        out.append(r)
        return r

    lmax = Rg + env + waits.largest
    # (a) one GPU shared by generation and learner, in one process (h = 0)
    sync = row("(a) 1 GPU shared", "sync", B0, Rg + env + waits.emax(B0) + Ug, "sum (serial)")
    for e in a.overlap:
        gpu, chain = Rg + Ug - e * min(Rg, Ug), Rg + env + waits.mean
        r = row("(a) 1 GPU shared", f"async, overlap e={e:g}", B0, max(gpu, chain),
                "shared GPU" if gpu >= chain else "rollout side (waits)", sync, lmax)
        if r["k"] > 1:
            T1 = max(gpu, Rg + env + waits.emax(B0))
            row("(a) 1 GPU shared", f"async, e={e:g}, k = 1", B0, T1,
                "shared GPU" if gpu >= T1 else "rollout side (slowest episode)", sync, k="1: too small")
    # (b) and (c): N rollout GPUs + M learner GPUs
    for N, M in [(1, 1)] + a.gpus:
        case = "(b) 1 rollout + 1 learner GPU" if (N, M) == (1, 1) else f"(c) {N} rollout + {M} learner GPUs"
        B = B0 * N
        gen_side = Rg * N / S(N, a.rollout_eff) + env
        ls = Ug * N / S(M, a.learner_eff) + h
        rs_sync, rs_async = gen_side + waits.emax(B), gen_side + waits.mean
        sync = row(case, "sync", B, rs_sync + ls,
                   f"sum (larger: {'rollout' if rs_sync >= ls else 'learner'} side)")
        r = row(case, "async", B, max(rs_async, ls), "rollout side" if rs_async >= ls else "learner side",
                sync, gen_side + waits.largest)
        if r["k"] > 1:
            row(case, "async, k = 1", B, max(rs_sync, ls),
                "rollout side (slowest episode)" if rs_sync >= ls else "learner side", sync, k="1: too small")
        G, Bc = N + M, B0 * (N + M)
        Tc = Rg * G / S(G, a.rollout_eff) + env + waits.emax(Bc) + Ug * G / S(G, a.learner_eff) + h
        row(case, f"sync, colocated on all {G}", Bc, Tc, "sum (serial)", sync)
    return out


def table(rs: list[dict], tok_per_ep: float) -> str:
    head = ("| case | tool waits | mode | episodes / iter | iteration s | episodes/s | generated tok/s "
            "| vs sync | bound by | k needed |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['case']} | {r['waits']} | {r['mode']} | {r['B']} | {r['T']:.2f} | {r['eps']:.1f} "
        f"| {r['eps'] * tok_per_ep:,.0f} | {r['speedup']:.2f}x | {r['bound']} | {r['k']} |\n" for r in rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--handover", type=float, default=0.05, help="adapter hand-over, s (ASSUMED; b, c)")
    ap.add_argument("--overlap", type=float, nargs="+", default=[0.0, 0.5], help="one-GPU overlap efficiencies e")
    ap.add_argument("--rollout-eff", type=float, default=1.0, help="eta_r: each extra rollout GPU adds this")
    ap.add_argument("--learner-eff", type=float, default=0.9, help="eta_l: each extra learner GPU adds this")
    ap.add_argument("--gpus", default="4x4,3x5", help="(c) cases, NxM = N rollout x M learner GPUs")
    ap.add_argument("--critic", choices=["learner", "rollout"], default="learner", help="critic features' side")
    ap.add_argument("--wait-median", type=float, default=1.0)
    ap.add_argument("--wait-sigma", type=float, default=0.5)
    ap.add_argument("--tail-p", type=float, default=0.05)
    ap.add_argument("--tail-s", type=float, default=10.0)
    ap.add_argument("--trials", type=int, default=200, help="Monte Carlo trials for E[max of n waits]")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "async_timeline.txt"))
    a = ap.parse_args()
    a.gpus = [tuple(int(x) for x in g.split("x")) for g in a.gpus.split(",") if g]
    p = phases(RUN2, a.critic)
    waits = Waits(a.wait_median, a.wait_sigma, a.tail_p, a.tail_s, a.trials)
    tok_per_ep = RUN2["tokens"] / RUN2["episodes"]
    rs = rows(p, a, NO_WAITS, "none (run 2)") + rows(p, a, waits, "long tail")
    cmd = " ".join([".venv/bin/python", "benchmarks/async_timeline.py", *sys.argv[1:]])
    text = (
        f"# Asynchronous training: a timeline MODEL, not a measurement ({DATE})\n\n"
        f"command: `{cmd}`\n\n"
        f"Measured inputs (docs/gpu.md run 2, iteration 2, one H200, Qwen2.5-1.5B shapes, duo, "
        f"{RUN2['episodes']} episodes x 256 tokens, {RUN2['tokens']:,} generated tokens): iteration "
        f"{RUN2['seconds']:.3f} s = generation {p['gen']:.3f} + behaviour log-probs {p['blp']:.3f} + learner "
        f"{p['learn']:.3f} + rest {p['rest']:.3f} (rest = rollout's CPU part {p['env']:.3f} + critic features and "
        f"update {p['critic']:.3f} + unaccounted {p['other']:.3f}).\n"
        f"Sides: rollout GPU work Rg = {p['Rg']:.3f} s, learner GPU work Ug = {p['Ug']:.3f} s (critic on the "
        f"{a.critic} side).\n"
        f"Assumed: adapter hand-over h = {a.handover:g} s (separate GPUs only; 0 on one GPU); rollout scaling "
        f"eta_r = {a.rollout_eff:g}, learner scaling eta_l = {a.learner_eff:g}; each rollout GPU plays "
        f"{RUN2['episodes']} episodes.\n"
        f"Long tail: one tool call per episode, log-normal median {a.wait_median:g} s sigma {a.wait_sigma:g}, "
        f"with probability {a.tail_p:g} it takes {a.tail_s:g} s instead; mean {waits.mean:.3f} s; E[max of n] "
        f"by Monte Carlo, random.Random(0), {a.trials} trials: "
        + ", ".join(f"n={n}: {waits.emax(n):.2f} s" for n in sorted({r['B'] for r in rs})) + ".\n\n"
        + table(rs, tok_per_ep))
    print(text, end="")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
