"""torch.compile in marft, both switches off by default until a GPU run has measured them (docs/gpu.md):

- ``rollout.compile``: the HF engine's static decode step, the whole model call, compiled once per
  base model and acting adapter (:func:`marft.engines.generation._compiled_step`, inside the CUDA graph);
- ``train.compile``: the learner's passes (forward + backward, behaviour and reference
  log-probabilities) with each decoder layer compiled on its own (:func:`compiled_layers`:
  "regional" compilation: the layers share their code, so one compilation serves them all, and the
  logits, the loss and the optimiser stay as they are).

What compiling buys is fusion: a layer's norms, rotary embeddings, activation and the adapters'
dtype casts become a few kernels instead of dozens, which is what bounds a small model's step on a
GPU (and, less, on a CPU). Shapes are dynamic, so a new batch or length is not a new compilation;
dynamo compiles again for each model, acting adapter (peft's active adapter is guarded on, so one
agent never runs another's compiled code) and grad mode, so the number of variants it keeps is
raised (:func:`configure`, with the other settings it needs). Where compiling fails (no compiler for the device, a model dynamo
cannot trace), the code runs as it is, with one warning.
"""
from __future__ import annotations

import contextlib

import torch

VARIANTS = 64  # compiled variants dynamo keeps per function: models x adapters x grad modes x attention kernels


def configure() -> None:
    """What marft's compiled code needs of torch.compile's settings (process-wide, set when a
    switch is on): dynamo keeps up to ``VARIANTS`` compiled variants of a function (default 8);
    dimensions of equal size get symbols of their own (no "duck sizing", which would tie a batch
    of 128 to a head dimension of 128 and compile again for the next batch size); and a backward
    is compiled with its forward, so that a backward that cannot compile fails where the fallback
    catches it rather than in the learner's ``loss.backward()``."""
    import torch._dynamo
    import torch._functorch.config
    import torch.fx.experimental._config

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), VARIANTS))
    for module, name, value in ((torch.fx.experimental._config, "use_duck_shape", False),
                                (torch._functorch.config, "force_non_lazy_backward_lowering", True)):
        if hasattr(module, name):
            setattr(module, name, value)


def warn_failed(what: str, switch: str, error: BaseException) -> None:
    """One warning per process and ``what``: it could not be compiled and runs as it is."""
    from ..errors import warn_once

    first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    warn_once(f"marft: {switch}: {what} could not be compiled ({type(error).__name__}: {first}); it runs without torch.compile")


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a (PEFT-wrapped) causal LM, or [] where it has no ``layers`` list."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


@contextlib.contextmanager
def compiled_layers(model):
    """Within the block, each decoder layer of ``model`` runs its compiled forward (what
    ``nn.Module.compile`` sets up, made once per layer and kept); afterwards the layers run as
    before, so decoding and the critic are untouched. Layers the user compiled are left alone."""
    layers = [layer for layer in decoder_layers(model)
              if layer._compiled_call_impl is None and getattr(layer, "_marft_compiled", None) is not False]
    if layers:
        configure()
    for layer in layers:
        if getattr(layer, "_marft_compiled", None) is None:
            layer._marft_compiled = torch.compile(layer._call_impl, dynamic=True)
        layer._compiled_call_impl = layer._marft_compiled
    try:
        yield
    finally:
        for layer in layers:  # back to nn.Module's own attribute (a guard of the compiled decode step reads it)
            layer.__dict__.pop("_compiled_call_impl", None)


def give_up(model) -> None:
    """:func:`compiled_layers` leaves ``model``'s layers uncompiled from now on (compiling failed)."""
    for layer in decoder_layers(model):
        layer._marft_compiled = False
        layer.__dict__.pop("_compiled_call_impl", None)
