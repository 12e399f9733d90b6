"""ScaledEfficiency: one class of terms scaled, the others untouched; predictions follow."""

import pytest

from flexplan.estimator.efficiency import TERM_CLASSES, DefaultEfficiency, ScaledEfficiency
from flexplan.hardware import get_hardware


def _base():
    return DefaultEfficiency.for_hardware(get_hardware("flexinfer-server2"))


def test_each_class_scales_only_its_methods():
    base = _base()
    s = ScaledEfficiency(base, {"cpu_memory": 2.0, "overhead": 3.0}, note="memory state: slow")
    assert s.cpu_memory(1, "float32") == pytest.approx(base.cpu_memory(1, "float32") / 2)
    assert s.cpu_attention(128, "float32") == pytest.approx(base.cpu_attention(128, "float32") / 2)
    assert s.cpu_compute(64, "float32") == base.cpu_compute(64, "float32")
    assert s.h2d(2**20) == base.h2d(2**20)
    assert s.gpu_compute(8) == base.gpu_compute(8)
    assert s.cpu_layer_overhead_s(1) == pytest.approx(3 * base.cpu_layer_overhead_s(1))
    assert s.source.endswith("memory state: slow")


def test_doubling_memory_time_doubles_a_memory_bound_decode():
    import flexplan

    hw = get_hardware("flexinfer-server2")
    base = _base()
    p1 = flexplan.plan("meta-llama/Llama-2-70b-hf", hardware=hw, batch_size=1, input_len=128, output_len=16,
                       prefill="cpu", decode="cpu", efficiency=base)
    s = ScaledEfficiency(base, {"cpu_memory": 2.0})
    p2 = flexplan.plan("meta-llama/Llama-2-70b-hf", hardware=hw, batch_size=1, input_len=128, output_len=16,
                       prefill="cpu", decode="cpu", efficiency=s)
    assert 1.8 < p2.tpot_s / p1.tpot_s <= 2.0 + 1e-9


@pytest.mark.parametrize("bad", [{"cpu_memory": 0.0}, {"cpu_memory": float("nan")}, {"disk": 1.0}])
def test_bad_scales_are_refused(bad):
    with pytest.raises(ValueError, match="term scales"):
        ScaledEfficiency(_base(), bad)


def test_classes_are_the_five_of_issue_14():
    assert set(TERM_CLASSES) == {"cpu_memory", "cpu_compute", "overhead", "link", "accelerator"}
