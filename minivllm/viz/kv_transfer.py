"""Pictures of the KV connector: the seven calls on a timeline, and the prefill/decode split.

`register_tracing_connector(base, log, name)` wraps a connector class so that every call of the
seven methods is recorded in `log` (side, method, engine step, a detail); it plugs in by name
through the public `register_connector`, so the engine keeps nothing for the pictures. The drawing functions
take recorded data and a matplotlib `Axes`, as every picture in `minivllm.viz` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minivllm.distributed.kv_transfer import KVConnectorBase, KVConnectorRole, register_connector
from minivllm.viz.style import COLORS

SCHEDULER_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "request_finished")
WORKER_METHODS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                  "wait_for_save")


@dataclass(frozen=True)
class ConnectorCall:
    """One recorded call: `index` (global order), `side` ("scheduler" / "worker"), `method`,
    `step` (the engine step it belongs to), `detail` (a short description of its arguments)."""

    index: int
    side: str
    method: str
    step: int
    detail: str
    time: float


class CallLog:
    """Where a tracing connector writes; `step` is advanced by the caller (one engine step)."""

    def __init__(self) -> None:
        self.calls: list[ConnectorCall] = []
        self.step = 0

    def record(self, side: str, method: str, detail: str) -> None:
        self.calls.append(ConnectorCall(len(self.calls), side, method, self.step, detail, time.perf_counter()))

    def methods(self, side: str | None = None) -> list[str]:
        return [c.method for c in self.calls if side is None or c.side == side]


def _detail(method: str, args: tuple) -> str:
    if method == "get_num_new_matched_tokens":
        return f"{args[0].request_id}, local hits={args[1]}"
    if method == "update_state_after_alloc":
        return f"{args[0].request_id}, {len(args[1])} blocks, external={args[2]}"
    if method == "request_finished":
        return args[0].request_id
    if method in ("wait_for_layer_load", "save_kv_layer"):
        return args[0]
    if method == "bind_connector_metadata":
        meta = args[0]
        return f"load {sum(len(r.load) for r in meta.requests)}, save {sum(len(r.save) for r in meta.requests)} blocks"
    return ""


def register_tracing_connector(base: type[KVConnectorBase], log: CallLog, name: str) -> str:
    """Register, under `name`, a subclass of `base` that records its seven methods in `log`;
    returns `name` (put it in `KVTransferConfig(kv_connector=name)`)."""

    def traced(method: str):
        def call(self, *args):
            side = "scheduler" if self.role is KVConnectorRole.SCHEDULER else "worker"
            log.record(side, method, _detail(method, args))
            return getattr(base, method)(self, *args)
        return call

    namespace = {method: traced(method) for method in SCHEDULER_METHODS + WORKER_METHODS}
    cls = type(name, (base,), namespace)
    globals()[name] = cls  # so the factory can import it by module and name
    register_connector(name, __name__, name)
    return name


def draw_connector_calls(calls: list[ConnectorCall], ax, title: str = "") -> None:
    """The calls as a timeline: one lane per method (scheduler side on top), x = call order,
    one vertical band per engine step."""
    methods = list(SCHEDULER_METHODS + WORKER_METHODS)
    for step in sorted({c.step for c in calls}):
        in_step = [c.index for c in calls if c.step == step]
        ax.axvspan(min(in_step) - 0.5, max(in_step) + 0.5, color=COLORS["idle"] if step % 2 else "white", zorder=0)
        ax.text((min(in_step) + max(in_step)) / 2, -0.9, f"step {step}", ha="center", fontsize=8)
    for call in calls:
        color = COLORS["waiting"] if call.side == "scheduler" else COLORS["running"]
        ax.scatter(call.index, methods.index(call.method), color=color, s=18, zorder=2)
    ax.axhline(len(SCHEDULER_METHODS) - 0.5, color=COLORS["edge"], linewidth=0.8)
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.set_ylim(len(methods) - 0.5, -1.3)
    ax.set_xlabel("call order (grey dots: scheduler side, blue: worker side)")
    ax.set_title(title or "The seven calls, as the engine makes them")


def draw_pd_split(requests: list[dict], ax) -> None:
    """Per request, two bars: the prefill instance computes the prompt; the decode instance
    loads the prompt's full blocks from the store, recomputes the rest and generates.

    Each entry: name, prompt (tokens), loaded (tokens the decode side loaded), generated."""
    bar = dict(height=0.5, edgecolor=COLORS["edge"])
    for i, r in enumerate(requests):
        y_prefill, y_decode = 2 * i + 1.0, 2 * i
        ax.barh(y_prefill, r["prompt"], color=COLORS["prompt"], **bar)
        ax.barh(y_decode, r["loaded"], color=COLORS["cached"], **bar)
        ax.barh(y_decode, r["prompt"] - r["loaded"], left=r["loaded"], color=COLORS["prompt"], **bar)
        ax.barh(y_decode, r["generated"], left=r["prompt"], color=COLORS["generated"], **bar)
        ax.annotate("", xy=(r["loaded"] / 2, y_decode + 0.25), xytext=(r["loaded"] / 2, y_prefill - 0.25),
                    arrowprops=dict(arrowstyle="->", color=COLORS["edge"]))
        ax.text(-2, y_prefill, f"{r['name']} · prefill instance", ha="right", va="center", fontsize=8)
        ax.text(-2, y_decode, f"{r['name']} · decode instance", ha="right", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("tokens (orange: computed prompt, yellow: loaded from the store, blue: generated)")
    ax.set_title("Prefill-decode disaggregation: KV crosses through the store")


def draw_transfer_costs(costs: dict[str, float], ax, unit: str = "ms") -> None:
    """One bar per way of getting a prompt's KV into the cache (measured seconds)."""
    names = list(costs)
    colors = [COLORS["prompt"], COLORS["cpu"], COLORS["gpu"], COLORS["swapped"]][:len(names)]
    ax.bar(names, [costs[n] * 1000 for n in names], color=colors, edgecolor=COLORS["edge"])
    ax.set_ylabel(unit)
    ax.set_title("Time to first token: recompute vs load")
