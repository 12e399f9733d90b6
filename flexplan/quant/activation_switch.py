"""The ``float_act`` switch of a module on GGUF blocks (QuantLinear, QuantExperts): llama.cpp's int8
activation (False, the default) or the exact float-activation path (True, the test path).

Rule: changing it notes a rebind (:mod:`flexplan.executor.rebinds`), since the native decoder
layers copied the switch into their weight structs and check those again only after a rebind.
"""

from __future__ import annotations

from flexplan.executor.rebinds import note_rebind


class FloatActivationSwitch:
    """Mixin: the ``float_act`` property of a module on blocks."""

    _float_act = False

    @property
    def float_act(self) -> bool:
        """The exact float-activation path (True) or llama.cpp's int8 activation (False)."""
        return self._float_act

    @float_act.setter
    def float_act(self, on: bool) -> None:
        self._float_act = bool(on)
        note_rebind()  # what the native decoder layers were told of this module is stale
