"""flexplan/compute_thread.py: a model (or engine) run on a thread other than the one that built it
says so, once; on its own thread, nothing."""

from __future__ import annotations

import copy
import threading
import warnings

import torch

from flexplan import api
from flexplan.serving.engine import Engine
from flexplan.serving.types import SamplingParams
from test_native_decode import _wide_model


def _on_a_thread(fn) -> list[warnings.WarningMessage]:
    caught: list = []

    def run():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            fn()
            fn()  # a second call: no second warning
        caught.extend(w for w in got if issubclass(w.category, RuntimeWarning))

    t = threading.Thread(target=run, name="a-worker")
    t.start()
    t.join()
    return caught


def test_generate_on_another_thread_warns_once_and_keeps_the_tokens(one_thread):
    ref = _wide_model("llama")
    lm = api.load(copy.deepcopy(ref), plan={"prefill": "cpu", "decode": "cpu", "cpu_dtype": "float32"},
                  accelerator="cpu", dtype="float32")
    ids = torch.tensor([[5, 17, 33, 9]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # on the loading thread: no warning
        here = lm.generate(ids, max_new_tokens=4)
    out = []
    caught = _on_a_thread(lambda: out.append(lm.generate(ids, max_new_tokens=4)))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "FlexModel.generate()" in text and "'a-worker'" in text and "load the model on this one" in text
    assert all(torch.equal(o, here) for o in out)


def test_an_engine_stepped_on_another_thread_warns_once(one_thread):
    e = Engine(_wide_model("llama"), block_size_tokens=4, host_blocks=32, device_blocks=0)
    e.add_request("a", [5, 17, 33], SamplingParams(max_tokens=2, temperature=0.0))
    caught = _on_a_thread(e.step)
    assert len(caught) == 1 and "Engine.step()" in str(caught[0].message)
    e.close()
