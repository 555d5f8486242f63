"""Ready-made reward functions for ``task.kind: dataset`` (see :mod:`marft.envs.dataset`), e.g.
``task.reward: marft.envs.rewards:gsm8k``. Each has the signature of every reward,
``reward(reply: str, record: dict) -> float``; write your own the same way.
"""
from __future__ import annotations

from marft.envs.math import grade_math
from marft.envs.sources import gsm8k_answer


def gsm8k(reply: str, record: dict) -> float:
    """1.0 when the reply's final answer (``\\boxed{}`` first, else the last number) equals the gold
    answer, else 0.0 (compared with math-verify, as the ``math`` task does).

    The gold answer is the record's ``final_answer`` (the original release's shape, in a file of
    your own) or, on the Hub's ``openai/gsm8k`` and its local copy in ``MARFT_DATA_DIR``, what
    follows ``####`` in its ``answer`` (the worked solution).
    """
    if record.get("final_answer") not in (None, ""):
        gold = str(record["final_answer"])
    else:
        gold = gsm8k_answer(str(record["answer"])) or str(record["answer"]).strip()
    return 1.0 if grade_math(reply, gold).correct else 0.0
