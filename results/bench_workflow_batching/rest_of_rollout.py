import sys, time, torch
from pathlib import Path
ROOT = Path.cwd(); sys.path.insert(0, str(ROOT))
from marft.api import prepare
from marft.config import load_config
from marft.engines import make_engine
from marft.trainer import play
torch.set_num_threads(2)
wf = load_config(ROOT / "configs/workflow_duo.yaml", ["rollout.episodes=32", "threads=2"])
team, models, make_wf = prepare(wf)
engine = make_engine(wf, models)
resets = [(1000 + e, {"split": "train"}) for e in range(32)]
for r in range(4):
    t0 = time.perf_counter()
    out = play(wf, team, engine, make_wf, resets, seed=r)
    s = time.perf_counter() - t0
    print(f"round {r}: {s:.2f} s, generating {out.gen_seconds:.2f} s, rest {s - out.gen_seconds:.2f} s")
