"""The rate MFU divides by: measured on a product large enough for the device, or the user's own
figure, and named in words."""
import pytest
import torch

from marft.engines import flops
from marft.errors import UserError


def test_rate_size_is_large_on_a_gpu():
    assert flops.rate_size("cpu") == 2048
    assert flops.rate_size("cuda") == flops.rate_size(torch.device("cuda", 0)) == 8192


def test_peak_override_replaces_the_measurement_and_is_named(monkeypatch):
    model = torch.nn.Linear(4, 4)
    monkeypatch.setenv("MARFT_PEAK_TFLOPS", "989.5")
    assert flops.machine_rate(model) == 989.5e12
    assert flops.rate_label(model) == "990 TFLOP/s (MARFT_PEAK_TFLOPS)"
    monkeypatch.delenv("MARFT_PEAK_TFLOPS")
    label = flops.rate_label(model)
    assert label.endswith("(2048^3 float32 product measured on cpu)") and float(label.split()[0]) > 0


@pytest.mark.parametrize("rate, shown", [(790.4e12, "790"), (2.34e12, "2.3"), (0.1e12, "0.1"), (0.043e12, "0.043")])
def test_a_measured_rate_is_named_with_its_digits(monkeypatch, rate, shown):
    # a busy 2-core CPU measured 0.04 TFLOP/s, once shown as "0.0 TFLOP/s"
    monkeypatch.setattr(flops, "machine_rate", lambda model: rate)
    assert flops.rate_label(torch.nn.Linear(4, 4)) == f"{shown} TFLOP/s (2048^3 float32 product measured on cpu)"


@pytest.mark.parametrize("bad", ["fast", "-3", "nan"])
def test_a_bad_peak_is_a_one_line_error(monkeypatch, bad):
    monkeypatch.setenv("MARFT_PEAK_TFLOPS", bad)
    with pytest.raises(UserError, match="MARFT_PEAK_TFLOPS"):
        flops.machine_rate(torch.nn.Linear(4, 4))


def test_learner_token_budget_is_the_config_or_the_cpu_default():
    from marft.engines.packing import CPU_TOKENS, token_budget

    model = torch.nn.Linear(4, 4)
    assert token_budget(model, 4096) == 4096
    assert token_budget(model, 0) == CPU_TOKENS == 2048
