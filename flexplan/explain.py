"""Human-readable rendering of a Plan (what `flexplan explain` prints)."""

from __future__ import annotations

import math

from flexplan.estimator.policies import REGISTRY, placement_of
from flexplan.hardware.spec import cpu_weight_dtype
from flexplan.plan_expert_cache import NO_CACHE
from flexplan.plan_types import PHASES, Plan

GiB = 1 << 30


def _t(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _b(x: float) -> str:
    return f"{x / GiB:.1f}" if x else "0"


def _cpu_side(p: Plan) -> str:
    held = cpu_weight_dtype(p.dtype, p.cpu_dtype)
    return f"CPU computes in {p.cpu_dtype}" + (f" on {held} weights" if held != p.cpu_dtype else "")


def _placement(p: Plan) -> str:
    """Layer by layer as the executor would run it (each phase's policy rule, FlexInfer 5.3 applied)."""
    try:
        return placement_of(p, p.num_layers).describe()
    except Exception as e:  # noqa: BLE001 - a plan of a policy no longer registered: say so, print the rest
        return f"unknown ({e})"


def _expert_cache_lines(p: Plan) -> list[str]:
    """For a plan with routed experts on the CPU: its expert cache (plan_expert_cache), or why none."""
    c = p.expert_cache
    if c is None:
        if "cpu-experts" not in (p.prefill.policy, p.decode.policy):
            return []

        why = next((n[len(NO_CACHE):] for n in p.notes if n.startswith(NO_CACHE)),
                   "plan with a routing profile (`flexplan profile-experts`, then --routing-profile) to cache the "
                   "most-used experts of the CPU layers on the accelerator")
        return [f"  expert cache: none ({why})"]
    k = [len(v) for v in c.experts.values()]
    hits = list(c.hit_rate.values())
    return [f"  expert cache: {c.num_experts} routed experts of {len(k)} CPU layers on the accelerator "
            f"({c.accelerator_bytes / GiB:.2f} GiB), {min(k)}-{max(k)} per layer, predicted hit rate "
            f"{100 * min(hits):.0f}-{100 * max(hits):.0f}% (mean {100 * sum(hits) / len(hits):.0f}%), "
            f"E2E {_t(c.saved_s)} lower; profile: {c.profile}",
            "    layer:experts(hit rate) " + " ".join(f"{i}:{len(v)}({100 * c.hit_rate[i]:.0f}%)"
                                                     for i, v in c.experts.items())]


def _split_lines(p: Plan) -> list[str]:
    """Each phase cut by split points: where, and one layer's per-operator timeline (Park & Egger 4.2)."""
    lines = []
    for ph in PHASES:
        sp = p.phases[ph].split_points
        if sp is None:
            continue
        i, j = sp.points
        lines.append(f"  {ph} split points ({i}, {j}) of {len(sp.operators)} operators ({sp.candidates} pairs "
                     f"searched, Eq. 13): CPU {', '.join(sp.on_cpu)}; accelerator {', '.join(sp.on_accelerator)}")
        if not sp.timeline:
            lines.append("    (fixed by hand: no timeline predicted)")
            continue
        lines.append(f"    one streamed layer {_t(sp.layer_s)} (Eq. 5): CPU {_t(sp.cpu_s)} (Eq. 6), "
                     f"link {_t(sp.h2d_s)} (Eq. 7 + activations)")
        lines.append(f"    {'operator':<46}{'on':<13}{'start':>10}{'end':>10}")
        for name, lane, start, end in sp.timeline:
            lines.append(f"    {name:<46}{lane:<13}{start * 1e3:>8.3f}ms{end * 1e3:>8.3f}ms")
    return lines


def _reference_baseline() -> tuple[str, str] | None:
    """(policy, the published system it reproduces) that sweeps compare against."""
    return next(((name, pol.reproduces) for name, pol in REGISTRY.items() if pol.reproduces), None)


def format_plan(p: Plan) -> str:
    lines = [
        f"{p.model} on {p.hardware}: batch {p.batch_size}, input {p.input_len}, output {p.output_len}, "
        f"{p.dtype} ({_cpu_side(p)}); GPU budget {_b(p.gpu_memory_bytes)} GiB, host {_b(p.cpu_memory_bytes)} GiB",
        f"efficiency factors: {p.calibration}",
    ]
    for ph in PHASES:
        label = "TTFT" if ph == "prefill" else "TPOT"
        lines += ["", f"{ph} candidates ({label}):",
                  f"  {'policy':<21}{'M':>4} {label:>10} {'GPU GiB':>8} {'host GiB':>9} {'PCIe GB':>9}  note"]
        for c in p.candidates:
            if c.phase != ph:
                continue
            chosen = (p.prefill if ph == "prefill" else p.decode)
            mark = "*" if c.feasible and c.policy == chosen.policy else " "
            pcie = f"{c.pcie_bytes / 1e9:.2f}" if c.feasible else "-"
            note = c.reason if not c.feasible else ("chosen" if mark == "*" else "")
            lines.append(f"{mark} {c.policy:<21}{c.gpu_layers:>4} {_t(c.time_s):>10} {_b(c.gpu_memory_bytes):>8} "
                         f"{_b(c.cpu_memory_bytes):>9} {pcie:>9}  {note}")
    lines += [
        "",
        f"chosen: prefill {p.prefill.policy} (M={p.prefill.gpu_layers}), decode {p.decode.policy} (M={p.decode.gpu_layers})",
        f"  TTFT {_t(p.ttft_s)}, TPOT {_t(p.tpot_s)}, initial load {_t(p.load_s)}, phase switch {_t(p.switch_s)}, "
        f"E2E {_t(p.e2e_s)}",
        f"  placement: {_placement(p)}",
        *_split_lines(p),
        *_expert_cache_lines(p),
        f"why: {p.reason}",
        "",
        "E2E against homogeneous baselines (same policy for both phases):",
    ]
    for name, e2e in p.baselines.items():
        if e2e is None or not math.isfinite(e2e):
            lines.append(f"  {name:<21} {'does not fit':>10}")
        else:
            lines.append(f"  {name:<21} {_t(e2e):>10}   flexplan is {100 * (1 - p.e2e_s / e2e):5.1f}% lower")
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


# operator groups in the order a token meets them (workload.gguf_config's groups)
GROUP_ORDER = ("embedding", "attention", "mlp", "router", "experts", "shared_experts", "norms", "final_norm", "lm_head")


def format_stored_weights(spec) -> str:
    """For a model read from a GGUF file: the format each operator group is stored in ("" for a
    model of plain tensors)."""
    formats: dict[str, list[str]] = {}
    for group, fmt, _ in spec.stored_weights:
        formats.setdefault(group, []).append(fmt)
    if not formats:
        return ""
    order = sorted(formats, key=lambda g: GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER))
    stored = ", ".join(f"{g} {'+'.join(formats[g])}" for g in order)
    tied = " (the tied head reads the embedding's)" if spec.tie_word_embeddings else ""
    return f"weights as {spec.name} stores them: {stored}{tied}"


def format_sweep(plans: list[Plan]) -> str:
    """One line per plan, and the mean reduction against the reference baseline (FlexGen)."""
    ref, label = _reference_baseline() or ("", "baseline")
    lines = [f"{'batch':>5} {'input':>6} {'output':>6}  {'prefill':<22} {'decode':<22} {'E2E':>10} "
             f"{label + ' E2E':>12} {'reduction':>9}"]
    reductions = []
    for p in plans:
        fg = p.baselines.get(ref)
        red = (1 - p.e2e_s / fg) if fg and math.isfinite(fg) else None
        if red is not None:
            reductions.append(red)
        lines.append(f"{p.batch_size:>5} {p.input_len:>6} {p.output_len:>6}  "
                     f"{p.prefill.policy + ' M=' + str(p.prefill.gpu_layers):<22} "
                     f"{p.decode.policy + ' M=' + str(p.decode.gpu_layers):<22} {_t(p.e2e_s):>10} {_t(fg):>12} "
                     f"{'-' if red is None else f'{100 * red:.1f}%':>9}")
    if reductions:
        lines.append(f"mean E2E reduction vs {ref} ({label}): {100 * sum(reductions) / len(reductions):.1f}% "
                     f"over {len(reductions)} shapes")
    return "\n".join(lines)
