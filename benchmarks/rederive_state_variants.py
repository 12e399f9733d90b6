"""``rederive_cycles.py`` with one of the memory-state laws changed, to judge the laws on a kept run.

The estimator's memory-state laws (``flexplan/estimator/efficiency.py``: ``StateScaledEfficiency``)
are constants and one rule each way; this re-prices a kept cycles run with one of them changed in
this process only, and prints ``rederive_cycles.py``'s table (recorded -> re-derived):

- ``power=P``: ``FASTER_STATE_SHARE_POWER`` = P (0: no share rule);
- ``elasticity=E``: ``FASTER_STATE_ELASTICITY`` = E;
- ``slower-full``: a slower state scales every op's streaming by the probe's full ratio (in place
  of ``min(own factor, best / scale)``, which leaves an op below the state's bandwidth unslowed).

    python benchmarks/rederive_state_variants.py power=0 benchmarks/results/calibration_cycles_zen4_run4-files
"""

from __future__ import annotations

import sys

import rederive_cycles  # noqa: E402


def apply(variant: str) -> None:
    from flexplan.estimator import efficiency as eff

    name, _, value = variant.partition("=")
    if name == "power":
        eff.FASTER_STATE_SHARE_POWER = float(value)
    elif name == "elasticity":
        eff.FASTER_STATE_ELASTICITY = float(value)
    elif name == "slower-full":
        faster = eff.StateScaledEfficiency._at_state

        def at_state(self, factor, dtype):
            s = self.scale("cpu_memory")
            if s <= 1.0:
                return faster(self, factor, dtype)
            at = factor / s
            return at / eff.state_change(s) ** self.learned_elasticity if self.learned_elasticity else at

        eff.StateScaledEfficiency._at_state = at_state
    else:
        raise SystemExit(f"unknown variant {variant!r}: use power=P, elasticity=E or slower-full")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    apply(sys.argv.pop(1))
    raise SystemExit(rederive_cycles.main())
