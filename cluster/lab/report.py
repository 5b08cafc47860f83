"""The retention lab's standard experiments (``v41 cache-sim report``).

On two workloads (the Mooncake chat trace stretched to 72 h, and the synthetic ``agent``
profile) and for both storage policies (V4.1: window states in RAM for minutes; V4:
window states on SSD with the chunks for 72 h), in scale mode:

- **retention**: hit rate per tier (token- and request-weighted) against the chunk
  retention, 0.5 h to 168 h; the 72 h runs' samples give bytes and objects per tier over
  time;
- **window**: window-state hit rate and Encoder SWA Bounded Replay rate against the
  window TTL and the RAM pool (agent workload);
- **ssd**: SSD capacity, write bandwidth and drive writes per day needed for 72 h
  against the request rate (the agent workload at several numbers of sessions);
- **cost**: per default run, prefill compute avoided and TTFT saved under a stated FLOP
  model (``Cost``), less the time to load what hit from RAM or SSD;
- **deployment**: a node of a fleet whose traffic RAM cannot hold for 72 h, against the
  chunk retention: what retention on SSD buys (:mod:`cluster.lab.deployment`).

Outputs in one directory: ``runs.parquet`` (one row per run), ``samples.parquet`` (one
row per run and sampled hour), ``summary.json``, PNG plots and ``report.md``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.lab import deployment

RETENTIONS_H = (0.5, 1.0, 2.0, 4.0, 8.0, 24.0, 48.0, 72.0, 168.0)
WINDOW_TTLS_MIN = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0)
RAM_GB = (12.5, 25.0, 50.0, 100.0, 200.0, 400.0)
SESSION_SCALES = (0.25, 0.5, 1.0, 2.0)
HOST_RAM_GB = 2048.0  # the RAM pool as a fraction of a 2 TB host
DEFAULTS = {"retention_h": 72.0, "window_ttl_min": 30.0, "ram_gb": 200.0}


@dataclass(frozen=True)
class Cost:
    """The stated cost model: prefill at ``flops_per_token`` on GPUs of ``gpu_tflops``
    at ``mfu``; loading a hit at the tier's bandwidth into the GPU."""

    flops_per_token: float = 2 * 8e9  # ~8B parameters active per prompt token (docs/DESIGN accounting)
    gpu_tflops: float = 989.0  # H200, dense BF16
    mfu: float = 0.4
    ram_gbps: float = 25.0  # host RAM -> GPU over PCIe 5 x16
    ssd_gbps: float = 6.0  # one NVMe Gen4 drive

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.gpu_tflops * 1e12 * self.mfu / self.flops_per_token


@dataclass(frozen=True)
class Job:
    """One simulation (``trace_rows``: the first rows of the chat trace only; tests)."""

    experiment: str
    workload: str  # "conversation" or "agent"
    policy: str  # "v41" or "v4"
    retention_h: float = DEFAULTS["retention_h"]
    window_ttl_min: float = DEFAULTS["window_ttl_min"]
    ram_gb: float = DEFAULTS["ram_gb"]
    sessions: int = 0  # agent workload
    hours: float = 0.0
    keep_samples: bool = False
    trace_rows: int | None = None


def jobs(agent_sessions: int, agent_hours: float, trace_rows: int | None = None) -> list[Job]:
    out = []
    for workload in ("conversation", "agent"):
        for policy in ("v41", "v4"):
            for retention in RETENTIONS_H:
                out.append(Job("retention", workload, policy, retention_h=retention, sessions=agent_sessions,
                               hours=agent_hours, keep_samples=retention == DEFAULTS["retention_h"],
                               trace_rows=trace_rows))
    for policy in ("v41", "v4"):
        out += [Job("window_ttl", "agent", policy, window_ttl_min=ttl, sessions=agent_sessions, hours=agent_hours)
                for ttl in WINDOW_TTLS_MIN if ttl != DEFAULTS["window_ttl_min"]]
        out += [Job("ram", "agent", policy, ram_gb=ram, sessions=agent_sessions, hours=agent_hours)
                for ram in RAM_GB if ram != DEFAULTS["ram_gb"]]
        out += [Job("ssd", "agent", policy, sessions=max(1, round(agent_sessions * scale)), hours=agent_hours)
                for scale in SESSION_SCALES if scale != 1.0]
    return out + deployment.jobs(Job, agent_sessions, agent_hours)


def _requests(job: Job):
    from cluster.lab import sessions, workload

    if job.workload == "conversation":
        rows = workload.read_trace(workload.CONVERSATION_TRACE)[: job.trace_rows]
        span_h = (max(r["timestamp"] for r in rows) + 1) / 3.6e6
        return workload.trace_requests(rows, stretch=72.0 / span_h)
    return sessions.synthetic(workload.Profile.named("agent", sessions=job.sessions, hours=job.hours))


def policy_sizes() -> dict:
    """Object sizes per policy (built once: serialising the released config takes ~1 s)."""
    from cluster.lab import sizes as sizes_module

    return {"v41": sizes_module.from_config(), "v4": sizes_module.v4_flash()}


def run_job(job: Job, sizes_by_policy: dict) -> dict:
    """One simulation: a row of ``runs.parquet`` (and its samples when kept)."""
    import torch

    from cluster.lab.sim_config import SimConfig
    from cluster.lab.simulate import simulate

    torch.set_num_threads(1)
    sizes = sizes_by_policy[job.policy]
    config = SimConfig(sizes, ram_bytes=int(job.ram_gb * 2**30), chunk_retention_hours=job.retention_h,
                       window_ttl_minutes=job.window_ttl_min,
                       hours=job.hours if job.workload == "agent" else None)
    result = simulate(config, _requests(job))
    totals = result.totals
    stored = [sum(s.bytes.values()) for s in result.samples]
    ssd = [s.bytes.get("ssd", 0) for s in result.samples]
    ssd_written = totals.chunk_bytes_written + (totals.window_bytes_written if sizes.persist_windows else 0)
    row = {**asdict(job), "requests": totals.requests, "input_tokens": totals.input_tokens,
           "virtual_hours": result.virtual_s / 3600, "request_rate": totals.requests / max(1.0, result.virtual_s),
           **result.rates, "hit_tokens_ram": totals.hit_tokens_ram, "hit_tokens_ssd": totals.hit_tokens_ssd,
           "prefill_tokens": totals.prefill_tokens, "chunk_bytes": sizes.chunk_bytes,
           "mean_stored_bytes": sum(stored) / max(1, len(stored)), "peak_stored_bytes": max(stored, default=0),
           "peak_ssd_bytes": max(ssd, default=0), "ssd_bytes_written": ssd_written,
           "ssd_write_bytes_per_s": ssd_written / max(1.0, result.virtual_s), "wall_s": result.wall_s}
    row["dwpd"] = row["ssd_write_bytes_per_s"] * 86400 / max(1, row["peak_ssd_bytes"])
    samples = [{"time_h": s.time_s / 3600, **{f"objects_{t}": n for t, n in s.objects.items()},
                **{f"bytes_{t}": b for t, b in s.bytes.items()}, "requests": s.requests,
                "chunk_bytes_written": s.chunk_bytes_written, "window_bytes_written": s.window_bytes_written}
               for s in result.samples] if job.keep_samples else []
    return {"row": row, "samples": samples}


def with_cost(row: dict, cost: Cost) -> dict:
    """Prefill avoided and TTFT saved per request under ``cost`` (the loads subtracted)."""
    per_token = row["chunk_bytes"] / 128
    prefill_s = (row["hit_tokens_ram"] + row["hit_tokens_ssd"]) / cost.prefill_tokens_per_s
    load_s = (row["hit_tokens_ram"] * per_token / (cost.ram_gbps * 1e9)
              + row["hit_tokens_ssd"] * per_token / (cost.ssd_gbps * 1e9))
    requests = max(1, row["requests"])
    return {**row, "prefill_gpu_hours_avoided_per_day": prefill_s / 3600 / max(1e-9, row["virtual_hours"] / 24),
            "ttft_saved_ms_per_request": 1e3 * (prefill_s - load_s) / requests,
            "load_ms_per_request": 1e3 * load_s / requests}


def run_all(out: Path, agent_sessions: int, agent_hours: float, cost: Cost = Cost(), workers: int = 2,
            progress=None, trace_rows: int | None = None) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    todo = jobs(agent_sessions, agent_hours, trace_rows)
    sizes = policy_sizes()
    rows, samples = [], []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for n, result in enumerate(pool.map(run_job, todo, [sizes] * len(todo)), 1):
            rows.append(with_cost(result["row"], cost))
            samples += [{"workload": result["row"]["workload"], "policy": result["row"]["policy"], **s}
                        for s in result["samples"]]
            if progress is not None:
                progress(n, len(todo))
    pq.write_table(pa.Table.from_pylist(rows), out / "runs.parquet")
    pq.write_table(pa.Table.from_pylist(samples), out / "samples.parquet")
    summary = summarize(rows)
    summary.update(agent_sessions=agent_sessions, agent_hours=agent_hours, cost={**asdict(cost),
                   "prefill_tokens_per_s": cost.prefill_tokens_per_s}, runs=len(rows),
                   wall_s=round(time.time() - started, 1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plots(rows, samples, out)
    (out / "report.md").write_text(markdown(summary, rows))
    return summary


def _default(rows: list[dict], workload: str, policy: str) -> dict:
    return next(r for r in rows if r["experiment"] == "retention" and r["workload"] == workload
                and r["policy"] == policy and r["retention_h"] == DEFAULTS["retention_h"])


def summarize(rows: list[dict]) -> dict:
    summary: dict = {"workloads": {}}
    for workload in ("conversation", "agent"):
        v41, v4 = _default(rows, workload, "v41"), _default(rows, workload, "v4")
        summary["workloads"][workload] = {
            "requests": v41["requests"], "virtual_hours": round(v41["virtual_hours"], 1),
            "stored_bytes_v41_over_v4": round(v41["mean_stored_bytes"] / max(1.0, v4["mean_stored_bytes"]), 4),
            "peak_ssd_bytes_v41_over_v4": round(v41["peak_ssd_bytes"] / max(1, v4["peak_ssd_bytes"]), 4),
            "policies": {p: {k: round(r[k], 4) for k in ("hit_rate_ram", "hit_rate_ssd", "hit_rate",
                                                          "window_hit_rate", "replay_rate", "dwpd",
                                                          "ttft_saved_ms_per_request",
                                                          "prefill_gpu_hours_avoided_per_day")}
                         | {"peak_ssd_tb": round(r["peak_ssd_bytes"] / 1e12, 3),
                            "ssd_write_mb_per_s": round(r["ssd_write_bytes_per_s"] / 1e6, 1)}
                         for p, r in (("v41", v41), ("v4", v4))}}
    summary["deployment"] = deployment.summarize(rows)
    return summary


def plots(rows: list[dict], samples: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"v41": "-", "v4": "--"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, workload in zip(axes, ("conversation", "agent")):
        for policy in ("v41", "v4"):
            runs = sorted((r for r in rows if r["experiment"] == "retention" and r["workload"] == workload
                           and r["policy"] == policy), key=lambda r: r["retention_h"])
            x = [r["retention_h"] for r in runs]
            for key, color in (("hit_rate", "k"), ("hit_rate_ram", "tab:blue"), ("hit_rate_ssd", "tab:orange")):
                ax.plot(x, [r[key] for r in runs], styles[policy], color=color, marker=".",
                        label=f"{policy} {key.replace('hit_rate', 'all').replace('all_', '')}")
        _log_ticks(ax, RETENTIONS_H)
        ax.set_xlabel("chunk retention (h)")
        ax.set_title(workload)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (token-weighted)")
    axes[1].legend(fontsize=7)
    _save(fig, out / "hit_rate_vs_retention.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, workload in zip(axes, ("conversation", "agent")):
        for policy in ("v41", "v4"):
            series = [s for s in samples if s["workload"] == workload and s["policy"] == policy]
            for tier, color in (("ram", "tab:blue"), ("ssd", "tab:orange")):
                ax.plot([s["time_h"] for s in series], [s.get(f"bytes_{tier}", 0) / 1e12 for s in series],
                        styles[policy], color=color, label=f"{policy} {tier}")
        ax.set_xlabel("virtual hours")
        ax.set_ylabel("TB stored")
        ax.set_title(f"{workload}, 72 h retention")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    _save(fig, out / "bytes_per_tier_over_time.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, (experiment, key, label) in zip(axes, (("window_ttl", "window_ttl_min", "window TTL (min)"),
                                                  ("ram", "ram_gb", "RAM pool (GB)"))):
        for policy in ("v41", "v4"):
            runs = sorted([r for r in rows if r["workload"] == "agent" and r["policy"] == policy and (
                r["experiment"] == experiment or (r["experiment"] == "retention"
                                                  and r["retention_h"] == DEFAULTS["retention_h"]))],
                          key=lambda r: r[key])
            ax.plot([r[key] for r in runs], [r["window_hit_rate"] for r in runs], styles[policy], marker=".",
                    color="tab:green", label=f"{policy} window-state hits")
            ax.plot([r[key] for r in runs], [r["replay_rate"] for r in runs], styles[policy], marker=".",
                    color="tab:red", label=f"{policy} replays per request")
        _log_ticks(ax, WINDOW_TTLS_MIN if experiment == "window_ttl" else RAM_GB)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("agent: window TTL")
    axes[1].set_title("agent: RAM pool")
    axes[1].legend(fontsize=7)
    _save(fig, out / "window_states.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy in ("v41", "v4"):
        runs = sorted([r for r in rows if r["workload"] == "agent" and r["policy"] == policy and (
            r["experiment"] == "ssd" or (r["experiment"] == "retention"
                                         and r["retention_h"] == DEFAULTS["retention_h"]))],
                      key=lambda r: r["request_rate"])
        x = [r["request_rate"] for r in runs]
        axes[0].plot(x, [r["peak_ssd_bytes"] / 1e12 for r in runs], styles[policy], marker=".", label=policy)
        axes[1].plot(x, [r["ssd_write_bytes_per_s"] / 1e6 for r in runs], styles[policy], marker=".", label=policy)
    axes[0].set_ylabel("SSD capacity for 72 h (TB, peak)")
    axes[1].set_ylabel("SSD writes (MB/s, mean)")
    for ax in axes:
        ax.set_xlabel("requests per second")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, out / "ssd_sizing.png")


def _log_ticks(ax, values) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(values))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{v:g}" for v in values])


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)


def markdown(summary: dict, rows: list[dict]) -> str:
    lines = ["# Retention lab report", "",
             (f"{summary['runs']} simulations in {summary['wall_s']} s (scale mode). Workloads: the Mooncake chat "
              f"trace stretched to 72 h; the agent profile, {summary['agent_sessions']:,} sessions over "
              f"{summary['agent_hours']} h. Defaults: 72 h chunk retention, 30 min window TTL, 200 GiB RAM, "
              "unbounded SSD. Hit rates are token-weighted."), ""]
    cost = summary["cost"]
    for workload, w in summary["workloads"].items():
        lines += [f"## {workload} ({w['requests']:,} requests, {w['virtual_hours']} virtual h)", "",
                  ("| policy | hit RAM | hit SSD | hit | window-state hits | replays/request | peak SSD (TB) | "
                   "SSD writes (MB/s) | DWPD | TTFT saved (ms/request) | prefill GPU-h avoided/day |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for policy, p in w["policies"].items():
            lines.append(f"| {policy} | {p['hit_rate_ram']:.3f} | {p['hit_rate_ssd']:.3f} | {p['hit_rate']:.3f} | "
                         f"{p['window_hit_rate']:.3f} | {p['replay_rate']:.3f} | {p['peak_ssd_tb']:.2f} | "
                         f"{p['ssd_write_mb_per_s']:.1f} | {p['dwpd']:.2f} | {p['ttft_saved_ms_per_request']:.0f} | "
                         f"{p['prefill_gpu_hours_avoided_per_day']:.1f} |")
        lines += ["", (f"Stored bytes V4.1 / V4 (time mean): **{w['stored_bytes_v41_over_v4']:.3f}**; "
                       f"peak SSD V4.1 / V4: {w['peak_ssd_bytes_v41_over_v4']:.3f}."), ""]
        lines += ["| retention (h) | " + " | ".join(f"{r:g}" for r in RETENTIONS_H) + " |",
                  "|---|" + "---:|" * len(RETENTIONS_H)]
        for policy in ("v41", "v4"):
            for key in ("hit_rate_ram", "hit_rate_ssd"):
                values = {r["retention_h"]: r[key] for r in rows if r["experiment"] == "retention"
                          and r["workload"] == workload and r["policy"] == policy}
                lines.append(f"| {policy} {key[9:].upper()} | " + " | ".join(f"{values[r]:.3f}" for r in RETENTIONS_H)
                             + " |")
        lines.append("")
    lines += deployment.markdown(summary.get("deployment", {}))
    lines += ["## Plots", "", "![hit rate vs retention](hit_rate_vs_retention.png)", "",
              "![bytes per tier over time](bytes_per_tier_over_time.png)", "",
              "![window states](window_states.png)", "", "![SSD sizing](ssd_sizing.png)", "",
              "## Cost model", "",
              (f"Prefill at {cost['flops_per_token'] / 1e9:.0f} GFLOP per prompt token on {cost['gpu_tflops']:.0f} "
               f"TFLOP/s GPUs at {cost['mfu']:.0%} MFU ({cost['prefill_tokens_per_s']:,.0f} tokens/s per GPU); a hit "
               f"loads at {cost['ram_gbps']:g} GB/s from RAM, {cost['ssd_gbps']:g} GB/s from SSD. TTFT saved = "
               "prefill time of the hit tokens less their load time, per request, one GPU per request."), "",
              ("Tables: `runs.parquet` (one row per simulation), `samples.parquet` (hourly tier contents of the "
               "72 h runs), `summary.json`."), ""]
    return "\n".join(lines)
