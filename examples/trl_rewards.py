"""Reward functions written for TRL's GRPOTrainer (``reward_funcs=[accuracy]``), which marft's
``task.kind: dataset`` calls as they are (configs/solo_grpo.yaml, docs/from_trl.md): by keyword,
``completions`` a list of reply texts, each data set column a list of the same length."""
import re


def accuracy(completions, answer, **kwargs):
    """1.0 where the completion's last ``\\boxed{...}`` (or, without one, its last number) is the answer."""
    rewards = []
    for text, gold in zip(completions, answer):
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        numbers = re.findall(r"-?\d+", boxed[-1] if boxed else text)
        rewards.append(1.0 if numbers and numbers[-1] == str(gold).strip() else 0.0)
    return rewards
