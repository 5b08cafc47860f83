"""The retention lab's scenario at a deployment's scale: what retention on SSD buys.

The report's default runs give a node far more RAM than its traffic needs for 72 hours
(the agent workload's 72 h of chunks fit in its 200 GiB pool), so they never read the
SSD tier. A deployment sized to its GPUs is not like that: here ``NODES`` nodes, each
with a host RAM pool of 10% of a 2 TB host (the seed's window pool), share agent traffic
of ``LOAD`` x the report's sessions per node (cache-affinity routing keeps a session on
one node, so one node's store sees its share), enough that RAM holds hours, not days.
One node is simulated per chunk retention (the V4.1 policy), from RAM-only horizons to
72 h and beyond; the table says what each buys in hit rate and TTFT, and what it costs
in SSD per node and across the fleet.
"""

from __future__ import annotations

NODES = 8
LOAD = 8  # sessions per node, x the report's agent sessions
HOST_RAM_GB = 2048.0
RAM_SHARE = 0.10  # the seed's window pool: 10% of host RAM
RETENTIONS_H = (0.5, 4.0, 24.0, 72.0, 168.0)
EXPERIMENT = "deployment"


def jobs(job_type, agent_sessions: int, agent_hours: float) -> list:
    """The scenario's simulations (``job_type``: :class:`cluster.lab.report.Job`)."""
    return [job_type(EXPERIMENT, "agent", "v41", retention_h=retention, ram_gb=HOST_RAM_GB * RAM_SHARE,
                     sessions=agent_sessions * LOAD, hours=agent_hours)
            for retention in RETENTIONS_H]


def summarize(rows: list[dict]) -> dict:
    """Per retention: hit rates by tier, TTFT saved, and SSD per node and per fleet."""
    runs = sorted((r for r in rows if r["experiment"] == EXPERIMENT), key=lambda r: r["retention_h"])
    if not runs:
        return {}
    first = runs[0]
    return {
        "nodes": NODES, "ram_gb_per_node": HOST_RAM_GB * RAM_SHARE, "sessions_per_node": first["sessions"],
        "requests_per_s_per_node": round(first["request_rate"], 2),
        "requests_per_s_fleet": round(first["request_rate"] * NODES, 1),
        "retention": {f"{r['retention_h']:g}": {
            "hit_rate_ram": round(r["hit_rate_ram"], 4), "hit_rate_ssd": round(r["hit_rate_ssd"], 4),
            "hit_rate": round(r["hit_rate"], 4), "ttft_saved_ms_per_request": round(r["ttft_saved_ms_per_request"]),
            "peak_ssd_tb_per_node": round(r["peak_ssd_bytes"] / 1e12, 3),
            "peak_ssd_tb_fleet": round(r["peak_ssd_bytes"] * NODES / 1e12, 2),
            "ssd_write_mb_per_s_per_node": round(r["ssd_write_bytes_per_s"] / 1e6, 2)} for r in runs}}


def markdown(summary: dict) -> list[str]:
    """The report's section for the scenario (no lines when it did not run)."""
    if not summary:
        return []
    lines = [f"## At a deployment's scale ({summary['nodes']} nodes)", "",
             (f"Each node: a {summary['ram_gb_per_node']:g} GiB RAM pool (10% of a 2 TB host), "
              f"{summary['sessions_per_node']:,} agent sessions ({summary['requests_per_s_per_node']} requests/s; "
              f"{summary['requests_per_s_fleet']} across the fleet), V4.1 policy. What each chunk retention buys:"),
             "", ("| retention (h) | hit RAM | hit SSD | hit | TTFT saved (ms/request) | peak SSD per node (TB) | "
                  "peak SSD, fleet (TB) | SSD writes per node (MB/s) |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for retention, r in summary["retention"].items():
        lines.append(f"| {retention} | {r['hit_rate_ram']:.3f} | {r['hit_rate_ssd']:.3f} | {r['hit_rate']:.3f} | "
                     f"{r['ttft_saved_ms_per_request']} | {r['peak_ssd_tb_per_node']:.3f} | "
                     f"{r['peak_ssd_tb_fleet']:.2f} | {r['ssd_write_mb_per_s_per_node']:.2f} |")
    return [*lines, ""]
