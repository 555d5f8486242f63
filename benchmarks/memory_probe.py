"""Where a run's resident memory goes, iteration by iteration: the process's resident set (RSS),
the same after glibc's ``malloc_trim(0)`` hands freed heap pages back to the system, and the bytes of
every live torch tensor (their storages, counted once) with the number of Python objects. RSS that
grows while the live tensors and objects stay constant is memory held below Python: freed heap the
allocator keeps (what ``malloc_trim`` returns) or native caches (what it does not, for example
oneDNN's primitive cache, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). Linux with glibc only.

    .venv/bin/python benchmarks/memory_probe.py --iterations 12 seed=0     # the main job, synchronous
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=16 .venv/bin/python benchmarks/memory_probe.py --iterations 12 seed=0

Trimming after every iteration changes the run it measures (the next iteration takes its pages from
the system again); the run's own ``memory/rss_gb`` metric, without trimming, is the figure to compare
settings by. Extra arguments are config overrides (``train.max_staleness=1``, ...)."""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from marft.api import prepare
from marft.assemble import build_trainer
from marft.engines.machine import cpu_line, memory_stats
from marft.run.config import load_config


def live_tensors() -> tuple[float, int]:
    """GB held by live tensors' storages (each counted once) and how many storages."""
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                s = o.untyped_storage()
            except RuntimeError:  # tensors without storage (meta, sparse)
                continue
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total / 1e9, len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/coop_duo_sum.yaml")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"output_dir={out}", *args.overrides])
        team, models, make_env = prepare(cfg)
        trainer = build_trainer(cfg, team, models, make_env, log=lambda m: None)
        print(f"{args.config} {' '.join(args.overrides)}; {cpu_line()}; torch {torch.__version__}; "
              f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', '(default)')}")
        print("| iteration | RSS GB | after malloc_trim GB | live tensors GB | tensors | Python objects |")
        print("|---|---|---|---|---|---|")
        for _ in range(args.iterations):
            m = trainer.iteration_step()
            gc.collect()
            gb, n = live_tensors()
            rss = memory_stats()["memory/rss_gb"]
            libc.malloc_trim(0)
            trimmed = memory_stats()["memory/rss_gb"]
            print(f"| {m['iteration']} | {rss:.3f} | {trimmed:.3f} | {gb:.3f} | {n} | {len(gc.get_objects())} |", flush=True)


if __name__ == "__main__":
    main()
