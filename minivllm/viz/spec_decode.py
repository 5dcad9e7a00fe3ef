"""Pictures of speculative decoding: what was proposed, what the target kept, and what it pays.

`SpecDecodeRecorder(engine)` watches a speculating engine from outside: it wraps the two
public callables of its `SpecDecodeWorker` (`proposer.propose` and `rejection_sampler`) and
keeps, per speculative step, each sequence's proposals and the tokens the rejection sampler
emitted. The runtime keeps nothing for it. `draw_spec_steps` draws one sequence's steps as
rows of tokens (accepted guesses, the rejected guess, the target's own token, guesses never
looked at); `draw_speedup_curves` draws curves of speedup against the acceptance rate
(computed by `minivllm.spec_decode.metrics.expected_speedup`) with measured points on them;
`draw_measured_speedups` sets the rows of `benchmarks/spec_decode.py` (measured speedup)
beside the speedup the theory expects for each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minivllm.viz.style import COLORS

# Roles of a proposed or emitted token, in the project's colours.
TOKEN_COLORS = {
    "accepted": COLORS["finished"],  # a guess the target kept
    "rejected": COLORS["copied"],  # the first guess the target did not keep
    "target": COLORS["generated"],  # the token the target drew itself (correction or bonus)
    "unused": COLORS["idle"],  # guesses after the rejected one: never looked at
}


@dataclass
class SpecStep:
    """One speculative step of one request (one sequence): the proposals and what was emitted."""

    step: int
    request_id: str
    proposed: list[int]
    emitted: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


class SpecDecodeRecorder:
    """Records every speculative step of `engine` (its worker must be a `SpecDecodeWorker`)."""

    def __init__(self, engine) -> None:
        worker = engine.model_executor.driver_worker
        self.steps: list[list[SpecStep]] = []
        self._proposals, self._request_ids = None, []
        propose, sampler = worker.proposer.propose, worker.rejection_sampler

        def recording_propose(seq_group_metadata_list, num_proposals):
            self._request_ids = [m.request_id for m, n in zip(seq_group_metadata_list, num_proposals) if n]
            self._proposals = propose(seq_group_metadata_list, num_proposals)
            return self._proposals

        def recording_sampler(*args, **kwargs):
            accepted = sampler(*args, **kwargs)
            self._record(accepted.tolist())
            return accepted

        worker.proposer.propose = recording_propose
        worker.rejection_sampler = recording_sampler

    def _record(self, accepted: list[list[int]]) -> None:
        proposals = self._proposals
        tokens = proposals.token_ids
        self.steps.append([
            SpecStep(len(self.steps), request_id, tokens[row][:n], [t for t in accepted[row] if t >= 0])
            for row, (request_id, n) in enumerate(zip(self._request_ids, proposals.num_proposed))])

    def of_request(self, request_id: str) -> list[SpecStep]:
        """`request_id`'s speculative steps, in order."""
        return [s for step in self.steps for s in step if s.request_id == request_id]


def draw_spec_steps(ax, steps: list[SpecStep], decode: Callable[[int], str] | None = None,
                    max_steps: int = 12) -> None:
    """One row per step: the accepted guesses, then the rejected guess (crossed out) with the
    target's own token beside it, or, when all were accepted, the bonus token; grey guesses
    were never looked at. `decode` labels the cells (token id -> text)."""
    decode = decode or str
    steps = steps[:max_steps]
    width = max(len(s.proposed) + 1 for s in steps)
    for y, step in enumerate(steps):
        cells = _cells(step)
        for x, (role, token) in enumerate(cells):
            ax.add_patch(_box(x, y, TOKEN_COLORS[role]))
            label = decode(token).replace("\n", "\\n")
            ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8,
                    color="white" if role in ("rejected", "target") else "black")
            if role == "rejected":
                ax.plot([x + 0.1, x + 0.9], [y + 0.5, y + 0.5], color="white", linewidth=1.5)
        ax.text(width + 0.2, y + 0.5, f"+{len(step.emitted)}", va="center", fontsize=9)
    ax.set_xlim(0, width + 1)
    ax.set_ylim(len(steps), 0)
    ax.set_yticks([y + 0.5 for y in range(len(steps))], [f"step {s.step}" for s in steps])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    handles = [_box(0, 0, color) for color in TOKEN_COLORS.values()]
    ax.legend(handles, ["accepted guess", "rejected guess", "target's own token", "never checked"],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, frameon=False, fontsize=8)


def _cells(step: SpecStep) -> list[tuple[str, int]]:
    """(role, token) per cell of a step's row."""
    m = step.num_accepted
    cells = [("accepted", t) for t in step.proposed[:m]]
    if m < len(step.proposed):
        cells.append(("rejected", step.proposed[m]))
        cells.append(("target", step.emitted[m]))
        cells += [("unused", t) for t in step.proposed[m + 1:]]
    else:
        cells.append(("target", step.emitted[m]))
    return cells


def _box(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle  # deferred: matplotlib is the notebooks' extra

    return Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, facecolor=color, edgecolor=COLORS["edge"], linewidth=0.5)


def draw_speedup_curves(ax, curves: dict[str, tuple[list[float], list[float]]], measured: dict | None = None,
                        title: str = "", ylabel: str = "expected speedup") -> None:
    """`curves`: label -> (acceptance rates, speedups); `measured`: label -> (alpha, speedup)."""
    for label, (alphas, speedups) in curves.items():
        ax.plot(alphas, speedups, label=label)
    for label, (alpha, speedup) in (measured or {}).items():
        ax.scatter([alpha], [speedup], color=COLORS["edge"], zorder=3)
        ax.annotate(label, (alpha, speedup), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.axhline(1.0, color=COLORS["idle"], linewidth=1)
    ax.set_xlabel("acceptance rate alpha (per guess)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def draw_distributions(ax, distributions: dict[str, list[float]], labels: list[str] | None = None) -> None:
    """Grouped bars, one group per token, one bar per distribution (e.g. the target p, the
    draft q, and what the rejection sampler emitted)."""
    names = list(distributions)
    width = 0.8 / len(names)
    palette = [COLORS["generated"], COLORS["prompt"], COLORS["finished"], COLORS["copied"]]
    num_tokens = len(next(iter(distributions.values())))
    for i, name in enumerate(names):
        xs = [t + (i - (len(names) - 1) / 2) * width for t in range(num_tokens)]
        ax.bar(xs, distributions[name], width=width, label=name, color=palette[i % len(palette)],
               edgecolor=COLORS["edge"], linewidth=0.5)
    ax.set_xticks(range(num_tokens), labels or [str(t) for t in range(num_tokens)])
    ax.set_xlabel("token")
    ax.set_ylabel("probability")
    ax.legend(fontsize=8)


def row_label(row: dict) -> str:
    """A `benchmarks/spec_decode.py` row's name: proposer, batch and workload.

    >>> row_label({"proposer": "ngram", "batch": 8, "workload": "repeat"})
    'n-gram, batch 8, repeat'
    """
    proposer = "n-gram" if row["proposer"] == "ngram" else row["proposer"]
    return f"{proposer}, batch {row['batch']}, {row['workload']}"


def draw_measured_speedups(ax, rows: list[dict], labels: list[str] | None = None, title: str = "") -> None:
    """Two bars per speculating row of `benchmarks/spec_decode.py` (keys `speedup` and
    `expected_speedup`): the measured speedup over the target alone, and the one Leviathan et
    al.'s Theorem 3.8 expects from the row's alpha and draft cost c. Bars left of the line at
    1 are slowdowns. `labels` name the rows (default: `row_label`)."""
    labels = labels or [row_label(r) for r in rows]
    ys = range(len(rows))
    for offset, key, name, color in ((-0.2, "speedup", "measured", COLORS["generated"]),
                                     (0.2, "expected_speedup", "expected (Theorem 3.8)", COLORS["idle"])):
        values = [r[key] for r in rows]
        ax.barh([y + offset for y in ys], values, height=0.4, label=name, color=color,
                edgecolor=COLORS["edge"], linewidth=0.5)
        for y, value in zip(ys, values):
            ax.text(value, y + offset, f" {value:.2f}×", va="center", fontsize=7)
    ax.axvline(1.0, color=COLORS["copied"], linewidth=1)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(max(r["speedup"], r["expected_speedup"]) for r in rows) * 1.2)
    ax.set_xlabel("speedup over the target alone (time per token)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
