"""Compiled against eager learner passes in bf16, each measured against the same pass in fp32: does
``train.compile`` (torch.compile of the learner's decoder layers) move the log-probabilities and the
adapter gradients further from fp32 than bf16 rounding already does?

    .venv/bin/python benchmarks/compiled_gradients.py     # 25 s on 2 CPU cores, more where it has not compiled before

The main job's model and solver adapter (its LoRA B perturbed, the same in both dtypes, so that every
LoRA weight has a gradient), 8 chats of about 120 tokens with 48 random reply tokens each,
temperature 0.7; one micro-batch, log-probabilities summed plus 0.01 x the entropies.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.engines import packing  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines.generation import encode_chats  # noqa: E402

from common import cpu_name  # noqa: E402
from decode import chats  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "configs/coop_duo_sum.yaml")


def rows_for(tok, prompts) -> list[packing.Row]:
    ids, mask = encode_chats(tok, prompts, "cpu")
    g = torch.Generator().manual_seed(1)
    return [packing.Row(torch.cat([ids[b][mask[b]], torch.randint(0, len(tok), (48,), generator=g)]), int(mask[b].sum()), 48)
            for b in range(len(prompts))]


def learner_pass(models, agent: str, prompts, compile: bool):
    """Log-probabilities and the adapter gradients of one micro-batch."""
    with models.acting(agent) as (model, tok):
        model.train()
        lp, ent, _ = packing.response_logprobs(model, rows_for(tok, prompts), 0.7, True, compile=compile)
        (lp.sum() + 0.01 * ent.sum()).backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    return lp.detach().float(), grads


def main() -> None:
    torch.set_num_threads(2)
    team, m16, _ = prepare(load_config(CONFIG, ["model.dtype=bfloat16"]))
    _, m32, _ = prepare(load_config(CONFIG, ["model.dtype=float32"]))
    agent = team.names[-1]
    adapter = m16.for_agent(agent)[2]
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=g) if "lora_B" in k else v for k, v in m16.adapter_state(adapter).items()}
    m16.load_adapter_state(adapter, state)
    m32.load_adapter_state(adapter, state)
    prompts = chats(8, 120)
    ref_lp, ref = learner_pass(m32, agent, prompts, False)
    eager_lp, eager = learner_pass(m16, agent, prompts, False)
    learner_pass(m16, agent, prompts, True)  # compiles
    comp_lp, comp = learner_pass(m16, agent, prompts, True)

    def rel(grads) -> float:
        num = sum(float((grads[n] - ref[n]).norm()) ** 2 for n in ref) ** 0.5
        return num / sum(float(ref[n].norm()) ** 2 for n in ref) ** 0.5

    mask = ref_lp != 0
    print(f"# {cpu_name()}, 2 threads, torch {torch.__version__}; against the fp32 pass")
    print("| bf16 pass | adapter gradients: relative error | log-probabilities: mean abs error |")
    print("|---|---|---|")
    for name, lp, grads in (("eager", eager_lp, eager), ("compiled (train.compile)", comp_lp, comp)):
        print(f"| {name} | {rel(grads):.4f} | {float((lp - ref_lp)[mask].abs().mean()):.4f} |")


if __name__ == "__main__":
    main()
