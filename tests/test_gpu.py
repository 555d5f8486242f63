"""The CUDA path, on the tiny model: sampling with a CPU generator, the static decode loop with and
without a CUDA graph, training and resuming across devices, the learner's passes, the MFU's rate.
Marked ``gpu``: skipped where there is no CUDA GPU; ``scripts/gpu_check.py`` runs them on one."""
import json

import pytest
import torch

from marft.cli import main
from marft.run.checkpoints import latest_checkpoint
from marft.engines.generation import Sampling, generate
from marft.engines.models import load_base

pytestmark = pytest.mark.gpu

from test_generation import CHATS  # noqa: E402


@pytest.fixture(scope="module")
def on_gpu(tiny_model_dir):
    model, tok = load_base(str(tiny_model_dir), "float32", "cuda")
    return model, tok, list(range(0, len(tok), 5))


def test_a_cpu_generator_samples_on_the_gpu_reproducibly(on_gpu):
    model, tok, stops = on_gpu
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    runs = [generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0)) for _ in range(2)]
    assert runs[0].response_ids.device.type == "cuda"
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)  # same seed, same device: same replies
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)


def test_the_cuda_graph_gives_the_eager_static_and_dynamic_replies(on_gpu):
    model, tok, stops = on_gpu
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    outs = {name: generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), **flags)
            for name, flags in [("graph", {}), ("eager static", {"graphs": False}), ("dynamic", {"static": False})]}
    for name in ("eager static", "dynamic"):
        assert torch.equal(outs["graph"].response_ids, outs[name].response_ids), name
        assert torch.allclose(outs["graph"].logprobs, outs[name].logprobs, atol=1e-4, rtol=0), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU (cuda:1)")
def test_the_cuda_graph_on_a_second_gpu_gives_the_eager_replies(tiny_model_dir):
    """A model on cuda:1, not the current device: the graph is captured there (an empty graph made
    on cuda:0 would replay the first step's logits at every step)."""
    model, tok = load_base(str(tiny_model_dir), "float32", "cuda:1")
    stops = list(range(0, len(tok), 5))
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    graph, eager = (generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), **flags)
                    for flags in ({}, {"graphs": False}))
    assert graph.response_ids.device == torch.device("cuda:1")
    assert torch.equal(graph.response_ids, eager.response_ids)
    assert torch.allclose(graph.logprobs, eager.logprobs, atol=1e-4, rtol=0)


def test_the_compiled_step_in_the_cuda_graph_gives_the_eager_replies(on_gpu):
    """rollout.compile on a GPU: the step compiled by inductor (Triton kernels), captured in the CUDA
    graph, gives the eager static loop's tokens in fp32, and a batch of another size needs no new
    compilation."""
    import torch._dynamo

    model, tok, stops = on_gpu
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    want = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), graphs=False)
    got = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), compile=True)
    assert torch.equal(want.response_ids, got.response_ids)
    assert torch.allclose(want.logprobs, got.logprobs, atol=1e-4, rtol=0)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    generate(model, tok, CHATS[:3], sampling, stops, torch.Generator().manual_seed(1), compile=True)
    assert counters["stats"]["unique_graphs"] == graphs


def test_gpu_and_cpu_agree_on_the_first_token(on_gpu, tiny_model_dir):
    """Same weights in fp32 on both devices and the same CPU generator: the first sampled token of
    every row (decided by the prefill alone) is the same."""
    model, tok, stops = on_gpu
    cpu, _ = load_base(str(tiny_model_dir), "float32", "cpu")
    sampling = Sampling(temperature=1.0, max_new_tokens=1)
    a = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(3))
    b = generate(cpu, tok, CHATS, sampling, stops, torch.Generator().manual_seed(3))
    assert torch.equal(a.response_ids.cpu(), b.response_ids)
    assert torch.allclose(a.logprobs.cpu(), b.logprobs, atol=1e-4)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_run_saved_on_one_device_resumes_on_the_other(tiny_overrides, tmp_path, first, then):
    run = tmp_path / f"{first}-{then}"
    args = [o for o in tiny_overrides if not o.startswith(("model.device", "output_dir"))]
    assert main(["train", "configs/duo_arithmetic.yaml", *args, f"model.device={first}", "train.iterations=2",
                 "train.save_every=1", f"output_dir={run}"]) == 0
    assert latest_checkpoint(run).name == "iter_000002"
    assert main(["train", "--resume", str(run), f"model.device={then}", "train.iterations=3"]) == 0
    assert [m["iteration"] for m in _metrics(run)] == [1, 2, 3]
    assert latest_checkpoint(run).name == "iter_000003"


@pytest.mark.parametrize("mode", ["pipelined", "streaming"])
def test_asynchronous_training_on_the_gpu(tiny_overrides, tmp_path, mode):
    """Generation threads on their own CUDA stream, beside the learner: the run ends, no batch is
    more than one version old (pipelined: every batch after the first exactly one), and pipelined
    gives the same run twice."""
    args = [o for o in tiny_overrides if not o.startswith(("model.device", "output_dir"))]
    runs = []
    for k in range(2 if mode == "pipelined" else 1):
        run = tmp_path / f"{mode}-{k}"
        assert main(["train", "configs/duo_arithmetic.yaml", *args, "model.device=cuda", "train.iterations=3",
                     "train.max_staleness=1", f"train.async_mode={mode}", f"output_dir={run}"]) == 0
        runs.append([{key: v for key, v in m.items() if key in ("reward", "accuracy", "approx_kl", "async/staleness_max")}
                     for m in _metrics(run)])
    ages = [m["async/staleness_max"] for m in runs[0]]
    assert ages == [0, 1, 1] if mode == "pipelined" else max(ages) <= 1
    if mode == "pipelined":
        assert runs[0] == runs[1]


@pytest.mark.parametrize("algorithm", ["marft", "marft-token", "ippo"])
def test_the_learning_critic_on_the_gpu(tiny_overrides, tmp_path, algorithm):
    """train.critic: lora on a GPU: the critic's adapter there, its value heads on the CPU (the
    features reach them with their gradient); the run trains, fits its critic and checkpoints."""
    run = tmp_path / algorithm
    args = [o for o in tiny_overrides if not o.startswith(("model.device", "output_dir"))]
    assert main(["train", "configs/duo_arithmetic.yaml", *args, "model.device=cuda", "train.iterations=1",
                 "train.critic=lora", f"train.algorithm={algorithm}", "train.save_every=1", f"output_dir={run}"]) == 0
    line = _metrics(run)[-1]
    losses = [v for k, v in line.items() if k.startswith("value_loss")]
    assert losses and all(v == v and v >= 0 for v in losses)
    assert (latest_checkpoint(run) / "adapters" / "critic").is_dir()


def test_auto_dtype_is_bf16_where_the_gpu_has_it_in_hardware():
    """model.dtype: auto: bf16 from compute capability 8.0 (A100, H100), float32 below (T4, V100),
    where torch would report bf16 as supported through emulation, which vLLM refuses."""
    from marft.engines.models import pick_dtype

    major, _ = torch.cuda.get_device_capability(0)
    assert pick_dtype("auto", torch.device("cuda:0")) == (torch.bfloat16 if major >= 8 else torch.float32)


def test_the_mfu_rate_on_a_gpu_is_a_large_product(on_gpu):
    from marft.engines import flops

    model, _, _ = on_gpu
    assert flops.rate_size(next(model.parameters()).device) == 8192
    assert "8192^3" in flops.rate_label(model)


def test_the_learner_token_budget_follows_the_gpu_memory(on_gpu):
    """Auto (0): about 16k tokens for Qwen2.5-1.5B's shapes on an H200 (measured: 77-88 GiB peak at
    16,384); here the tiny model's width gives a far larger budget, in multiples of 1,024."""
    from marft.engines.packing import token_budget

    model, _, _ = on_gpu
    budget = token_budget(model, 0)
    assert budget % 1024 == 0 and budget > 2048


def test_the_folded_adapter_on_the_gpu(tiny_model_dir):
    """rollout.fold_adapters on a GPU (the adapter folded into the base weights, CUDA graph) replies
    as the adapter layers do, in fp32, and leaves the base weights as they were."""
    from test_rollout import make, perturb
    from marft.engines.hf import HFEngine
    from marft.engines.models import _foldable_layers

    _, team, models = make(["model.device=cuda"], tiny_model_dir)
    perturb(models, team.adapters[0])
    model, _, adapter = models.for_agent(team.names[0])
    assert _foldable_layers(model, adapter) is not None
    before = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    folded = []
    orig = models.acting_merged
    models.acting_merged = lambda name: (folded.append(name), orig(name))[1]
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    outs = [HFEngine(models, merge=m).generate(team.names[0], CHATS, sampling, torch.Generator().manual_seed(0))
            for m in (True, False)]
    assert folded == [team.names[0]]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-4, rtol=0)
    after = dict(model.named_parameters())
    assert all(torch.equal(v, after[n]) for n, v in before.items())
