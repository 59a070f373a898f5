"""The step's launches per call: what the profiler counted on the device, named in bench's step rows."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from dispatch.bench.command import report_text
from dispatch.bench.launches import device_operations, gpu_launches


def test_only_the_devices_events_count():
    events = [SimpleNamespace(device_type=DeviceType.CUDA), SimpleNamespace(device_type=DeviceType.CPU),
              SimpleNamespace(device_type=DeviceType.CUDA)]
    assert device_operations(events) == 2
    assert device_operations([]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_no_gpu_no_count():
    assert gpu_launches(lambda: torch.ones(3) + 1) is None


@pytest.mark.gpu
def test_counts_each_kernel_of_one_call_after_its_warm_up():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.ones(1024, device="cuda")
    assert gpu_launches(lambda: x.add(1).mul_(2)) == 2  # two elementwise kernels, nothing else
    assert gpu_launches(lambda: x.sum().item()) >= 2  # the reduction and the copy back


def _step_row(**extra):
    row = dict(op="indexer_step", backend="a + b", layout="-", shape="B=1", median_us=20.0, GBps=None,
               TFLOPs=None, x_floor=None, rel_error=0.0, timing="graph", check="ok", quant_us=5.0, logits_us=8.0,
               topk_us=6.0, x_logits=2.5)
    row.update(extra)
    return row


def test_a_step_row_names_its_launches_where_they_were_counted():
    report = dict(machine="m", date="d", torch="t", triton="t", fp8_dtype="e4m3fn", ceilings=None,
                  dispatch_overhead=dict(decide_cached_us=1.0, build_plan_B128_us=30.0),
                  rows=[_step_row(launches=5)])
    assert "step = 2.50x logits; 5 launches)" in report_text(report)
    report["rows"] = [_step_row()]
    assert "step = 2.50x logits)" in report_text(report)


def test_the_report_says_whether_dispatchs_kernels_launched_with_dependent_launch(monkeypatch):
    # The step's figures differ by it (docs/benchmarks.md), so a report read later must say which it was.
    from dispatch.bench.command import _dependent_launch

    base = {"machine": "m", "date": "d", "torch": "t", "triton": None, "fp8_dtype": "e4m3fn", "ceilings": None,
            "dispatch_overhead": {"decide_cached_us": 1.0, "build_plan_B128_us": 2.0}, "rows": []}
    monkeypatch.setenv("DISPATCH_PDL", "0")
    assert "dependent launch off (DISPATCH_PDL=0)" in report_text({**base, "dependent_launch": _dependent_launch()})
    monkeypatch.delenv("DISPATCH_PDL")
    assert "dependent launch on where the GPU has it" in report_text({**base, "dependent_launch": _dependent_launch()})
    assert "dependent launch" not in report_text(base)  # a report saved before it was recorded
