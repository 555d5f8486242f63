"""Where a decode step and a learner pass spend their time, on one device: the variants of marft's
decode loop side by side (what each of its parts buys), the learner's packed forward + backward at
several micro-batch sizes, and the top kernels of each under torch.profiler.

    .venv/bin/python benchmarks/decode.py --config configs/duo_arithmetic.yaml model.name=DIR model.device=cuda
    .venv/bin/python benchmarks/decode.py --episodes 8 --prompt 40 --new 8 --rows 8   # a CPU smoke run

Prompts are chats of about ``--prompt`` tokens (a system turn and a user turn of varied length, so
that they are left-padded like a rollout's); every variant samples ``--new`` tokens per prompt with
the first agent's adapter active, after a warm-up of its own. Tokens/s counts the generated tokens.
The log-prob gap is the mean |sampler - learner| log-probability of the sampled tokens, the learner
scoring them through the adapter layers (``rollout/logprob_gap``): kernel rounding, plus for a folded
adapter the rounding of ``W + B A`` to the weight's dtype. A fresh adapter (B = 0) folds to W
itself; give ``--adapters`` of a trained run to see what folding a real update costs:

    .venv/bin/python benchmarks/decode.py --config configs/coop_duo_sum.yaml --decode-only \
        --adapters RUN/checkpoints/latest/adapters --episodes 32 --prompt 120 --new 24 --no-profile
The learner rows are those prompts with ``--reply`` random reply tokens each (``--rows`` of them);
MFU = needed FLOPs (marft.engines.flops: forward + backward through a frozen base) / seconds / the device's
matrix rate (marft.engines.flops.rate_label).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marft.engines.generation as gen  # noqa: E402
from marft.engines import flops, packing  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines.generation import Sampling, encode_chats, generate, sequence_logprobs  # noqa: E402
from marft.engines.models import stop_token_ids  # noqa: E402

from common import CONFIG  # noqa: E402

WORDS = "plan add the numbers then check each digit carry the one and write the sum".split()


def chats(n: int, tokens: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        words = max(4, tokens // 2 - 20 + (i * 7) % 15)
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        out.append([{"role": "system", "content": "You are the planner of a team that solves problems together."},
                    {"role": "user", "content": f"Problem {i}: {text}"}])
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--reply", type=int, default=256)
    p.add_argument("--json")
    p.add_argument("--adapters", help="a run's adapters folder (checkpoints/latest/adapters): act with trained "
                                      "adapters, whose folding the log-prob gap column then measures")
    p.add_argument("--decode-only", action="store_true", help="skip the learner's part")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, [*args.overrides, "team.max_new_tokens={}"])
    team, models, _ = prepare(cfg)
    if args.adapters:
        models.load_adapters(args.adapters)
    agent = team.names[0]
    base = next(iter(models.bases.values()))
    device = next(base.parameters()).device
    rate = flops.machine_rate(base)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {where}; MFU against {flops.rate_label(base)}; {args.episodes} prompts of about {args.prompt} tokens, "
          f"{args.new} new tokens each")
    prompts = chats(args.episodes, args.prompt)
    sampling = Sampling(temperature=1.0, max_new_tokens=args.new)
    result = {"device": where, "rate": flops.rate_label(base), "decode": [], "learner": []}

    def run(flags, grouped=True, mode="layers", n=None):
        gen.GROUPED_DECODE = grouped
        ctx = {"reference": models.reference, "folded": models.acting_merged, "layers": models.acting}[mode](agent)
        with ctx as (model, tok):
            out = generate(model, tok, prompts[:n] if n else prompts, sampling, stop_token_ids(model, tok),
                           torch.Generator().manual_seed(0), **flags)
        gen.GROUPED_DECODE = True
        return out

    variants = [("marft's GPU default (static loop, CUDA graph, grouped attention)", {"static": True}, True, "layers"),
                ("the same, adapter folded into the weights (rollout.fold_adapters)", {"static": True}, True, "folded"),
                ("static loop, CUDA graph, the model's sdpa attention", {"static": True}, False, "layers"),
                ("static loop, no CUDA graph, grouped attention", {"static": True, "graphs": False}, True, "layers"),
                ("the CPU's loop (dynamic cache, compaction)", {"static": False}, True, "layers"),
                ("static loop, CUDA graph, grouped attention, adapters off (base model)", {"static": True}, True, "reference"),
                # last: the warm-up compiles (dynamic shapes: once for every batch size)
                ("marft's GPU default, step compiled (rollout.compile)", {"static": True, "compile": True}, True, "layers"),
                ("the same, adapter folded (rollout.compile + rollout.fold_adapters)", {"static": True, "compile": True}, True,
                 "folded")]

    def gap(out) -> float:
        """Mean |sampler - learner| log-probability of the sampled tokens: the learner scores them
        through the adapter layers in one teacher-forced pass (what rollout/logprob_gap measures)."""
        with models.acting(agent) as (model, _), torch.no_grad():
            lp = sequence_logprobs(model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                   sampling.temperature)
        m = out.response_mask
        return float((lp - out.logprobs)[m].abs().mean())

    print("| decode variant | seconds | generated tokens/s | ms per step | mean abs log-prob gap to the learner |")
    print("|---|---|---|---|---|")
    for name, flags, grouped, mode in variants:
        run(flags, grouped, mode, n=min(4, args.episodes))  # warm-up
        holder = {}
        s = timed(lambda: holder.update(out=run(flags, grouped, mode)), device)
        n = int(holder["out"].response_mask.sum())
        steps = holder["out"].response_mask.shape[1]
        g = gap(holder["out"]) if mode != "reference" else None
        print(f"| {name} | {s:.2f} | {n / s:.0f} | {1e3 * s / steps:.2f} | {'' if g is None else f'{g:.2e}'} |", flush=True)
        result["decode"].append({"variant": name, "seconds": s, "tokens": n, "tokens_per_s": n / s,
                                 "ms_per_step": 1e3 * s / steps, "logprob_gap": g})
    with models.acting(agent) as (model, tok):
        ids, mask = encode_chats(tok, prompts, device)
        stops = stop_token_ids(model, tok)

        def hf():
            model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=args.new, min_new_tokens=args.new, eos_token_id=stops, pad_token_id=tok.pad_token_id)

        model.generate(input_ids=ids[:4], attention_mask=mask[:4].long(), max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
        s = timed(hf, device)
    n = args.episodes * args.new
    print(f"| transformers generate (adapter active) | {s:.2f} | {n / s:.0f} | {1e3 * s / args.new:.2f} | |", flush=True)
    result["decode"].append({"variant": "transformers generate", "seconds": s, "tokens": n, "tokens_per_s": n / s})

    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        short = Sampling(temperature=1.0, max_new_tokens=16)
        for label, grouped in (("grouped attention", True), ("sdpa attention", False)):
            gen.GROUPED_DECODE = grouped
            with models.acting(agent) as (model, tok), profile(activities=acts) as prof:
                generate(model, tok, prompts, short, stop_token_ids(model, tok), torch.Generator().manual_seed(0), static=True,
                         graphs=False)
                sync(device)
            gen.GROUPED_DECODE = True
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"\n# top operators of 16 decode steps without a CUDA graph, {label} (by self {key.split('_')[1]} time)")
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))

    if args.decode_only:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    # the learner: packed forward + backward at several micro-batch sizes
    with models.acting(agent) as (model, tok):
        g = torch.Generator().manual_seed(0)
        rows = []
        for ids_row in [ids[b][mask[b]].cpu() for b in range(min(args.rows, len(prompts)))]:
            reply = torch.randint(0, len(tok), (args.reply,), generator=g)
            rows.append(packing.Row(torch.cat([ids_row, reply]), len(ids_row), args.reply))
        shape = flops.model_shape(model)
        print("\n| learner micro-batch tokens | shared prefix | compiled (train.compile) | micro-batches | seconds | MFU |")
        print("|---|---|---|---|---|---|")
        for tokens, share, compiled in ((4096, True, False), (8192, True, False), (16384, True, False), (16384, False, False),
                                        (16384, False, True)):  # last: train.compile (its warm-up compiles)
            groups = packing.micro_batches([r.length for r in rows], tokens, 0)
            packing.SHARE_PREFIX = share

            def learn():
                for grp in groups:
                    lp, ent, _ = packing.response_logprobs(model, [rows[i] for i in grp], 1.0, True, compile=compiled)
                    (lp.sum() + ent.sum()).backward()

            try:
                learn()  # warm-up
                s = timed(learn, device)
            except torch.OutOfMemoryError:
                print(f"| {tokens} | {share} | {compiled} | {len(groups)} | out of memory | |")
                continue
            finally:
                packing.SHARE_PREFIX = True
                model.zero_grad(set_to_none=True)
            need = packing.needed_work(rows, tokens, 0).flops(shape, backward=True)
            print(f"| {tokens} | {share} | {compiled} | {len(groups)} | {s:.2f} | {need / s / rate:.1%} |", flush=True)
            result["learner"].append({"tokens": tokens, "share_prefix": share, "compiled": compiled, "seconds": s,
                                      "mfu": need / s / rate})
        if not args.no_profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            groups = packing.micro_batches([r.length for r in rows], 16384, 0)
            with profile(activities=acts) as prof:
                lp, ent, _ = packing.response_logprobs(model, [rows[i] for i in groups[0]], 1.0, True)
                (lp.sum() + ent.sum()).backward()
                sync(device)
            model.zero_grad(set_to_none=True)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"\n# top operators of one learner micro-batch ({len(groups[0])} rows), forward + backward")
            print(prof.key_averages().table(sort_by=key, row_limit=16, max_name_column_width=60))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
