"""The learner's attention on a CPU: marft/engines/attention.py against transformers' eager attention and
PyTorch's scaled-dot-product kernel (what the model uses by default), side by side in one process.

    .venv/bin/python benchmarks/attention.py          # ~3 min, 2 threads

1. One layer's attention, forward + backward, on the shapes of a default-duo solver micro-batch
   ([8, 9, 153, 64] queries over 201 keys, 3 key/value heads, a causal mask offset by a cached
   prefix), bf16: milliseconds per call, best of 5.
2. The learner's passes (packed, forward + backward, entropy) over the solver replies of one rollout
   of the default duo (configs/duo_arithmetic.yaml), each attention in turn, interleaved over 3
   rounds: best and median seconds, and the activations saved for the backward per token.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.engines import packing  # noqa: E402
from marft.engines.attention import attention as marft_attention  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.run.learner import PolicyBatch  # noqa: E402
from marft.assemble import build_trainer  # noqa: E402

from common import CONFIG, PINNED  # noqa: E402

CHOICES = {"marft_cpu (marft/engines/attention.py)": "marft_cpu", "eager (transformers)": "eager",
           "sdpa (PyTorch's kernel, the model's default)": None}


def one_layer() -> None:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups = 3
        training = False

    b, h, kvh, Lq, Lk, d = 8, 9, 3, 153, 201, 64
    allowed = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
    add = torch.zeros(1, 1, Lq, Lk, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min)

    def sdpa(q, k, v):
        rep = h // kvh
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed)

    fns = {"marft_cpu (marft/engines/attention.py)": lambda q, k, v: marft_attention(M(), q, k, v, add, d ** -0.5)[0],
           "eager (transformers)": lambda q, k, v: eager_attention_forward(M(), q, k, v, add, d ** -0.5)[0],
           "sdpa (PyTorch's kernel, the model's default)": sdpa}
    print(f"# one layer, forward + backward, bf16: [{b}, {h}, {Lq}, {d}] queries over {Lk} keys ({kvh} key/value heads)")
    print("| attention | ms per layer (best of 5) |")
    print("|---|---|")
    for name, fn in fns.items():
        q = torch.randn(b, h, Lq, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, kvh, Lk, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, kvh, Lk, d, dtype=torch.bfloat16, requires_grad=True)
        best = float("inf")
        for i in range(7):
            t0 = time.perf_counter()
            fn(q, k, v).float().sum().backward()
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
        print(f"| {name} | {1000 * best:.1f} |")


def learner() -> None:
    cfg = load_config(CONFIG, [*PINNED, "threads=2", "output_dir=/tmp/marft-bench-attention"])
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    out = tr.play(0)
    agent = team.names[-1]
    rows = [(i, r) for i, t in enumerate(out.turns) if t.agent == agent for r in range(len(t.episodes))]
    learner = tr.policy.learners[team[agent].adapter]
    batch = PolicyBatch.of(out.turns, [torch.zeros(len(t.episodes)) for t in out.turns], rows, [rows])  # no loss here
    packed = batch.packed_rows()
    for p in models.adapter_parameters(team[agent].adapter):
        p.requires_grad_(True)
    mbs = learner._micro_batches(batch, batch.rows)
    tokens = sum(packed[i][r].length for i, r in batch.rows)

    weights = {p.untyped_storage().data_ptr() for p in tr._base().parameters()}

    def passes(saved: dict | None = None):
        def keep(t):  # every storage the backward keeps, once, weights excluded
            ptr = t.untyped_storage().data_ptr()
            if saved is not None and ptr not in weights:
                saved[ptr] = t.untyped_storage().nbytes()
            return t
        with models.acting(agent) as (model, _), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            for mb in mbs:
                lp, ent = learner._logprobs(model, batch, mb, True)
                (1e-3 * lp.sum() + ent).backward()

    times: dict[str, list[float]] = {k: [] for k in CHOICES}
    saved_mb: dict[str, float] = {}
    for name, impl in CHOICES.items():  # warm-up, and the saved bytes of the first micro-batch
        packing.CPU_ATTENTION = impl
        passes()
        s: dict = {}
        mbs_all, mbs[:] = list(mbs), mbs[:1]
        passes(s)
        saved_mb[name] = sum(s.values()) / sum(packed[i][r].length for mb in mbs for i, r in mb) / 2**20
        mbs[:] = mbs_all
    for _ in range(3):
        for name, impl in CHOICES.items():
            packing.CPU_ATTENTION = impl
            t0 = time.perf_counter()
            passes()
            times[name].append(time.perf_counter() - t0)
    packing.CPU_ATTENTION = "marft_cpu"
    print()
    print(f"# learner passes over {len(rows)} {agent} replies ({tokens} tokens, {len(mbs)} micro-batches), "
          f"forward + backward, {str(next(tr._base().parameters()).dtype).replace('torch.', '')}, "
          f"{torch.get_num_threads()} threads, 3 interleaved rounds")
    print("| attention | best s | median s | saved for backward, MB per token |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {statistics.median(ts):.2f} | {saved_mb[name]:.2f} |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    one_layer()
    learner()
