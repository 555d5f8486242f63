"""marft: multi-agent reinforcement fine-tuning for teams of LLM agents (MARFT, arXiv 2504.16129).

The Python API (:mod:`marft.api`)::

    import marft
    config = marft.load_config("configs/duo_arithmetic.yaml", train={"iterations": 20})
    with marft.MarftTrainer(config) as trainer:
        result = trainer.train()
    team = marft.load_team(result.run_dir)
"""

from .api import MarftConfig, MarftTrainer, TrainedTeam, TrainResult, evaluate, load_config, load_team
from .errors import UserError

__version__ = "0.1.0"
__all__ = ["MarftConfig", "MarftTrainer", "TrainResult", "TrainedTeam", "UserError", "evaluate", "load_config", "load_team"]
