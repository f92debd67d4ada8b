"""How ``halfway show`` and ``halfway gradients`` print a job's gradient samples and its
precision decision, for people: shares as percentages, magnitudes as powers of two (2^-30.1),
headroom in doublings (how many times the gradients could double before float16 overflows).
The figures are the API's (see docs/concepts.md): ``G`` is the gradient of the scaled loss as the
optimizer received it, the shadow's ``g32`` the float32 reference on the same batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from rich.table import Table
from rich.text import Text

from service.client.render import fmt_number
from service.vocabulary import GRADIENT_MODEL_ROW

Sample = Mapping[str, Any]

# The float32 shadow's figures: null on samples where it did not run.
SHADOW_FIGURES = ("underflow_share", "lost_share", "relative_error")


def _half_up(value: float, *, places: int | None = None, digits: int | None = None) -> Decimal:
    """``value`` rounded half away from zero to ``places`` decimals or ``digits`` significant
    digits, as JavaScript's toFixed and toPrecision round: the dashboard (gradients.js) and
    these commands then print the same figure, never 3.12% here and 3.13% there."""
    exact = Decimal(value)
    if digits is not None:
        places = digits - 1 - exact.adjusted() if exact else 0
    rounded = exact.quantize(Decimal(1).scaleb(-(places or 0)), rounding=ROUND_HALF_UP)
    return rounded if rounded else Decimal(0)  # no "-0"


def _plain(number: Decimal) -> str:
    """A Decimal without exponent or trailing zeros: 50, 12.5, 0.781."""
    text = f"{number:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_share(value: float | None) -> str:
    """A share as a percentage with three significant digits; never "0%" or "100%" for a
    share that is not exactly that (a tiny lost share is still a loss)."""
    if value is None:
        return "-"
    if value == 0 or value == 1:
        return f"{value:.0%}"
    percent = value * 100
    if percent < 0.01:
        return "<0.01%"
    if percent > 99.99:
        return ">99.99%"
    return f"{_plain(_half_up(percent, digits=3))}%"


def fmt_log2(value: float | None) -> str:
    """A log2 magnitude as the power of two it is: 2^-24, 2^-3.2."""
    if value is None:
        return "-"
    return f"2^{_plain(_half_up(value, places=1))}"


def fmt_headroom(value: float | None) -> str:
    if value is None:
        return "-"
    rounded = _half_up(value, places=1)
    return f"{rounded:.1f} doubling{'' if rounded == 1 else 's'}"


def fmt_error(value: float | None) -> str:
    return "-" if value is None else f"{float(_half_up(value, digits=3)):g}"


def fmt_seconds_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def figures_line(sample: Sample) -> str:
    """The model-level figures of one sample in a line: where its gradients sit and how much
    room is left above them."""
    parts = [
        f"step {sample['step']} at loss scale {fmt_number(sample.get('loss_scale'))}",
        f"max |G| {fmt_log2(sample.get('log2_max'))}"
        f" (headroom {fmt_headroom(sample.get('headroom'))})",
        f"smallest nonzero {fmt_log2(sample.get('log2_min_nonzero'))}",
        f"zero {fmt_share(sample.get('zero_share'))}",
        f"subnormal {fmt_share(sample.get('subnormal_share'))}",
    ]
    if sample.get("finite") is False:
        parts.append("NOT FINITE (overflow)")
    return ", ".join(parts)


def shadow_line(sample: Sample) -> str:
    """What the float32 shadow found at one sample: what float16 flushes at this scale, what
    this run really lost, how far its gradient is from float32's."""
    return (
        f"step {sample['step']} at loss scale {fmt_number(sample.get('loss_scale'))}: "
        f"underflow {fmt_share(sample.get('underflow_share'))}, "
        f"lost {fmt_share(sample.get('lost_share'))}, "
        f"relative error {fmt_error(sample.get('relative_error'))}"
    )


def gradient_rows(job: Mapping[str, Any]) -> list[tuple[str, Text]]:
    """``halfway show``'s lines for the latest sample and the latest shadow sample, and the
    precision decision's headline (its probes are ``decision_table``)."""
    rows: list[tuple[str, Text]] = []
    summary = job.get("gradients") or {}
    latest, shadow = summary.get("latest"), summary.get("latest_shadow")
    if latest:
        style = "red" if latest.get("finite") is False else ""
        rows.append(("gradients", Text(figures_line(latest), style=style)))
    if shadow:
        rows.append(("float32 shadow", Text(shadow_line(shadow))))
    decision = job.get("precision_decision")
    if decision:
        rows.append(
            (
                "precision decision",
                Text.assemble((str(decision.get("policy")), "bold"), f": {decision.get('reason')}"),
            )
        )
    return rows


def decision_table(decision: Mapping[str, Any]) -> Table:
    """The probes ``policy: auto`` ran, one row per candidate: speed, loss against float32's,
    overflows and what the shadow measured, whether it was eligible and why (or why not)."""
    chosen = decision.get("policy")
    table = Table(
        title=f"Precision probes (policy auto chose {chosen})",
        title_justify="left",
        caption="* the policy chosen; loss gap is against float32's mean loss",
        caption_justify="left",
    )
    for name in (
        "",
        "policy",
        "step ms",
        "mean loss",
        "loss gap",
        "overflows",
        "underflow",
        "lost",
        "eligible",
        "why",
    ):
        table.add_column(name, justify="left" if name in ("", "policy", "why") else "right")
    for probe in decision.get("probes") or []:
        picked = probe.get("policy") == chosen
        steps = probe.get("steps")
        overflows = f"{probe.get('overflow_steps')}" + (f"/{steps}" if steps is not None else "")
        table.add_row(
            Text("*", style="bold green") if picked else "",
            Text(str(probe.get("policy")), style="bold" if picked else ""),
            fmt_seconds_ms(probe.get("median_step_seconds")),
            fmt_number(probe.get("mean_loss")),
            fmt_error(probe.get("loss_gap")),
            overflows,
            fmt_share(probe.get("underflow_share")),
            fmt_share(probe.get("lost_share")),
            Text("yes", style="green") if probe.get("eligible") else Text("no", style="yellow"),
            Text(str(probe.get("why") or "")),
        )
    return table


FIGURE_COLUMNS = (
    ("zero", "zero_share", fmt_share),
    ("max |G|", "log2_max", fmt_log2),
    ("min nonzero", "log2_min_nonzero", fmt_log2),
    ("headroom", "headroom", fmt_headroom),
    ("subnormal", "subnormal_share", fmt_share),
)
SHADOW_COLUMNS = (
    ("underflow", "underflow_share", fmt_share),
    ("lost", "lost_share", fmt_share),
    ("rel. error", "relative_error", fmt_error),
)


def samples_table(job_id: int, samples: Sequence[Sample], status: str) -> Table:
    """The sampled steps, whole-model figures, one row each; the shadow's columns are filled
    on the steps where it ran."""
    table = Table(
        title=f"Job {job_id} gradient samples ({status})",
        title_justify="left",
        caption="underflow, lost and rel. error come from the float32 shadow; - where it did "
        "not run. Red rows: the gradients were not finite.",
        caption_justify="left",
    )
    for name in ("step", "loss scale", *(c[0] for c in FIGURE_COLUMNS + SHADOW_COLUMNS)):
        table.add_column(name, justify="right")
    for sample in samples:
        overflow = sample.get("finite") is False
        table.add_row(
            str(sample["step"]),
            fmt_number(sample.get("loss_scale")),
            *(fmt(sample.get(key)) for _, key, fmt in FIGURE_COLUMNS + SHADOW_COLUMNS),
            style="red" if overflow else None,
        )
    return table


def variables_table(job_id: int, sample: Sample) -> Table:
    """One sample's figures for each trainable variable (the whole model's first), so the
    layers whose gradients flush or overflow can be named."""
    shadow = bool(sample.get("shadow"))
    columns = FIGURE_COLUMNS + (SHADOW_COLUMNS if shadow else ())
    kind = "with the float32 shadow" if shadow else "no shadow at this step"
    table = Table(
        title=f"Job {job_id} gradients by variable at step {sample['step']} "
        f"(loss scale {fmt_number(sample.get('loss_scale'))}; {kind})",
        title_justify="left",
    )
    table.add_column("variable", justify="left", overflow="fold")
    for name, _, _ in columns:
        table.add_column(name, justify="right")
    table.add_column("finite", justify="left")
    whole = {**sample, "name": GRADIENT_MODEL_ROW}
    for row in [whole, *(sample.get("variables") or [])]:
        overflow = row.get("finite") is False
        table.add_row(
            Text(str(row.get("name")), style="bold" if row is whole else ""),
            *(fmt(row.get(key)) for _, key, fmt in columns),
            Text("NO", style="bold red") if overflow else "yes",
            style="red" if overflow else None,
        )
    return table
