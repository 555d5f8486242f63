"""Shared fixtures: a tiny randomly initialised chat model with a real byte-level tokenizer and a
chat template, built offline in a temporary folder (a second or two), and a config pointing at it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); scripts/gpu_check.py runs these on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "You are the planner of a team that solves problems together.",
    "Calculate 12 + 7. Give the final answer in \\boxed{}. The answer is 19.",
    "Messages from your teammates: first add the numbers, then check the result.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) planner solver verifier reflector step by step",
]


def build_tiny_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write a tiny Llama-architecture chat model (random weights) and its tokenizer to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory) -> Path:
    """A second tiny model with other weights (agents with their own base model)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-b"), seed=1)


@pytest.fixture
def tiny_overrides(tiny_model_dir, tmp_path) -> list[str]:
    """Config overrides that run the default team on the tiny model, quickly."""
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
            "rollout.max_new_tokens=8", "rollout.episodes=4", f"output_dir={tmp_path / 'run'}",
            "eval.problems=4", "team.max_new_tokens={}"]


VOWEL_ENV = '''
from marft.envs.base import TurnBasedEnv, Problem, Grade

class Vowel(TurnBasedEnv):
    """Reward 1 when the reply starts with a vowel (about 1 in 10 for the untrained tiny model)."""
    def new_problem(self, rng, split, index):
        return Problem("Say a word.", None)
    def grade(self, problem, reply):
        return Grade(reply.strip()[:1].lower() in tuple("aeiou"), True)
'''


@pytest.fixture(scope="session")
def vowel_env_path(tmp_path_factory) -> Path:
    """A custom environment file: ``task.env=<path>:Vowel`` (a trivial task the tiny model can learn)."""
    path = tmp_path_factory.mktemp("vowel-env") / "vowel_env.py"
    path.write_text(VOWEL_ENV)
    return path
