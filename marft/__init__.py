"""marft: multi-agent reinforcement fine-tuning for teams of LLM agents (MARFT, arXiv 2504.16129)."""

__version__ = "0.1.0"
