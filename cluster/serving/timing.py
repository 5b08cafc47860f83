"""A request's trip, stage by stage, as HTTP ``Server-Timing`` (and back).

The router marks the moments of a request's trip (Unix seconds by name: ``router_in``,
``rendered``, ``planned``, ...; the replicas add theirs to the first token's
:class:`actors.events.Admission`); each stage is the time between two marks.
"""

from __future__ import annotations

_STAGES = (
    ("parse", "router_in", "rendered"),  # body, validation, chat template, tokens
    ("plan", "rendered", "planned"),  # the index lookup of the cache plan
    ("dispatch", "planned", "router_sent"),  # Engram lookup started, calls to the pools sent
    ("to_prefill", "router_sent", "prefill_in"),
    ("prefill_wait", "prefill_in", "prefill_read"),  # the prefill replica's queue
    ("prefill", "prefill_read", "prefill_out"),  # store reads + encoder
    ("handoff", "prefill_out", "decode_in"),  # result back, decoder call, object transfer
    ("decode", "decode_in", "decode_out"),  # load, replay, first token
    ("stream", "decode_out", "first_token"),  # first stream item to the router
    ("respond", "first_token", "router_out"),
)


def server_timing(marks: dict[str, float], replica_s: float, prefilled_by: str) -> str:
    """An HTTP ``Server-Timing`` value: each stage of the trip and the replicas' own
    compute, in milliseconds (stages whose marks are missing are left out); the
    prefill stage says where it ran (``desc="pool"`` or ``desc="decoder"``)."""
    parts = []
    for name, a, b in _STAGES:
        if a in marks and b in marks:
            desc = f';desc="{prefilled_by}"' if name == "prefill" and prefilled_by else ""
            parts.append(f"{name};dur={1e3 * (marks[b] - marks[a]):.3f}{desc}")
    return ", ".join(parts + [f"compute;dur={1e3 * replica_s:.3f}"])


def store_times(marks: dict[str, float]) -> dict[str, str]:
    """When the prompt's stored prefix was looked up (the router's index lookup, or the
    prefill's read of its own store where no index answered) and when the answer's
    conversation counts as stored (Unix seconds: its last token reached the router,
    which from then on holds a turn that continues it until the store has it): the
    two moments that decide which turns find which chunks, for a replay that checks
    the simulator against the cluster."""
    times = {"lookup": marks.get("looked_up", marks.get("prefill_read")), "stored": marks.get("stored")}
    return {f"x-v41-{name}-at": f"{at:.6f}" for name, at in times.items() if at is not None}


def parse_server_timing(header: str) -> tuple[dict[str, float], dict[str, str]]:
    """A ``Server-Timing`` value -> ({name: ms}, {name: desc})."""
    durations, descriptions = {}, {}
    for part in header.split(","):
        name, *params = part.strip().split(";")
        for key, _, value in (param.partition("=") for param in params):
            if key == "dur":
                durations[name] = float(value)
            elif key == "desc":
                descriptions[name] = value.strip('"')
    return durations, descriptions
