"""One command for a load sweep against a running dlm-triton stack.

Runs headless Locust (``benchmarks/locustfile.py``) once per user count, keeps Locust's CSVs,
and writes ``summary.csv`` plus ``summary.png``: throughput (requests/s, generated tokens/s) and
latency percentiles (end-to-end and time to first token) against concurrent users::

    python benchmarks/run_load.py --host http://localhost:9000 --users 1,2,4,8 \\
        --run-time 60s --out out/load

Diffusion settings and the prompt mix go through the locustfile's ``DLM_LOAD_*`` variables
(``--param steps=16`` and ``--model`` are shortcuts). Nothing here asserts: tests do.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
SUMMARY_FIELDS = [
    "users",
    "kind",
    "name",
    "requests",
    "failures",
    "requests_per_s",
    "tokens_per_s",
    "avg_ms",
    "p50_ms",
    "p90_ms",
    "p99_ms",
]


@dataclass
class Row:
    """One line of Locust's ``*_stats.csv`` for one user count."""

    users: int
    kind: str  # E2E | TTFT
    name: str
    requests: int
    failures: int
    requests_per_s: float
    tokens_per_s: float
    avg_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float


def _num(value: str) -> float:
    """Locust writes ``N/A`` for empty percentiles."""
    try:
        return float(value)
    except ValueError:
        return float("nan")


def read_stats(path: Path, users: int) -> list[Row]:
    """Our custom-event rows (E2E, TTFT) of a Locust ``*_stats.csv``, plus an all-E2E total."""
    rows: list[Row] = []
    with path.open(newline="") as fh:
        for rec in csv.DictReader(fh):
            if rec["Type"] not in ("E2E", "TTFT"):
                continue
            rps = _num(rec["Requests/s"])
            rows.append(
                Row(
                    users=users,
                    kind=rec["Type"],
                    name=rec["Name"],
                    requests=int(rec["Request Count"]),
                    failures=int(rec["Failure Count"]),
                    requests_per_s=rps,
                    # response_length of an E2E event is its completion tokens.
                    tokens_per_s=_num(rec["Average Content Size"]) * rps
                    if rec["Type"] == "E2E"
                    else 0.0,
                    avg_ms=_num(rec["Average Response Time"]),
                    p50_ms=_num(rec["50%"]),
                    p90_ms=_num(rec["90%"]),
                    p99_ms=_num(rec["99%"]),
                )
            )
    e2e = [r for r in rows if r.kind == "E2E"]
    if e2e:
        n = sum(r.requests for r in e2e) or 1
        rows.append(
            Row(
                users=users,
                kind="E2E",
                name="all",
                requests=sum(r.requests for r in e2e),
                failures=sum(r.failures for r in e2e),
                requests_per_s=sum(r.requests_per_s for r in e2e),
                tokens_per_s=sum(r.tokens_per_s for r in e2e),
                # Request-weighted means of per-name percentiles: an approximation, labelled so.
                avg_ms=sum(r.avg_ms * r.requests for r in e2e) / n,
                p50_ms=sum(r.p50_ms * r.requests for r in e2e) / n,
                p90_ms=sum(r.p90_ms * r.requests for r in e2e) / n,
                p99_ms=sum(r.p99_ms * r.requests for r in e2e) / n,
            )
        )
    return rows


def locust_command(
    users: int,
    host: str,
    csv_prefix: Path,
    *,
    spawn_rate: int | None = None,
    run_time: str = "20s",
    stop_timeout: int = 60,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The headless Locust command line for one run of benchmarks/locustfile.py."""
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "--users",
        str(users),
        "--spawn-rate",
        str(spawn_rate or users),
        "--run-time",
        run_time,
        "--stop-timeout",
        str(stop_timeout),
        "--host",
        host,
        "--csv",
        str(csv_prefix),
        *extra,
    ]


def run_locust(
    users: int,
    args: argparse.Namespace,
    env: dict[str, str],
    out: Path,
) -> tuple[int, Path]:
    """One headless Locust run; returns its exit code (1 = some failures) and stats CSV."""
    prefix = out / f"u{users:03d}"
    cmd = locust_command(
        users,
        args.host,
        prefix,
        spawn_rate=args.spawn_rate,
        run_time=args.run_time,
        stop_timeout=args.stop_timeout,
        extra=("--loglevel", "WARNING", *args.user_class),
    )
    print(f"== {users} users: {' '.join(cmd[3:])}", flush=True)
    with (out / f"u{users:03d}.log").open("w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return proc.returncode, Path(f"{prefix}_stats.csv")


def write_summary(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def plot_summary(rows: list[Row], path: Path, title: str) -> None:
    """Three panels against users: throughput, end-to-end and time-to-first-token percentiles.

    Locust's percentiles include failed requests, so failed requests/s are drawn on the
    throughput panel: a latency curve is only meaningful where that line stays at zero.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_e2e, ax_ttft) = plt.subplots(1, 3, figsize=(18, 5.5))
    total = sorted((r for r in rows if r.kind == "E2E" and r.name == "all"), key=lambda r: r.users)
    users = [r.users for r in total]
    ax_tp.plot(users, [r.tokens_per_s for r in total], "o-", color="tab:blue", label="tokens/s")
    ax_tp.set_ylabel("generated tokens/s", color="tab:blue")
    ax_tp.set_ylim(bottom=0)
    ax_rps = ax_tp.twinx()
    ax_rps.plot(
        users, [r.requests_per_s for r in total], "s--", color="tab:orange", label="requests/s"
    )
    failed = [r.requests_per_s * r.failures / r.requests if r.requests else 0.0 for r in total]
    ax_rps.plot(users, failed, "x:", color="tab:red", label="failed requests/s")
    ax_rps.set_ylabel("requests/s", color="tab:orange")
    ax_rps.set_ylim(bottom=0)
    ax_tp.set_title("Throughput")
    lines = ax_tp.get_legend_handles_labels()
    more = ax_rps.get_legend_handles_labels()
    ax_tp.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")

    styles = {"p50_ms": "-", "p90_ms": "--", "p99_ms": ":"}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    every_name = sorted({r.name for r in rows if r.name != "all"})
    color = {name: palette[i % len(palette)] for i, name in enumerate(every_name)}
    for ax, kind, label in (
        (ax_e2e, "E2E", "End-to-end latency"),
        (ax_ttft, "TTFT", "Time to first token (streaming)"),
    ):
        names = sorted({r.name for r in rows if r.kind == kind and r.name != "all"})
        for name in names:
            series = sorted(
                (r for r in rows if r.kind == kind and r.name == name), key=lambda r: r.users
            )
            for attr, style in styles.items():
                ax.plot(
                    [r.users for r in series],
                    [getattr(r, attr) / 1000.0 for r in series],
                    style,
                    marker="o",
                    color=color[name],
                    label=f"{name} {attr[:-3]}",
                )
        ax.set_title(label)
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        if names:
            ax.legend(fontsize=7, ncol=2)
    for ax in (ax_tp, ax_e2e, ax_ttft):
        ax.set_xlabel("concurrent users")
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(users or [1])
        ax.set_xticklabels([str(u) for u in users] or ["1"])
        if users:
            ax.set_xlim(min(users) / 1.25, max(users) * 1.25)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--host", default="http://localhost:9000", help="the OpenAI proxy")
    parser.add_argument("--triton-grpc", default=None, help="Triton gRPC host:port (gRPC users)")
    parser.add_argument("--model", default=None, help="model name (DLM_LOAD_MODEL)")
    parser.add_argument("--users", default="1,2,4,8", help="comma-separated user counts")
    parser.add_argument("--spawn-rate", type=float, default=None, help="default: all at once")
    parser.add_argument("--run-time", default="60s", help="per user count, Locust syntax")
    parser.add_argument("--stop-timeout", type=int, default=60, help="seconds to finish requests")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sampling parameter for every request (JSON value), e.g. steps=16",
    )
    parser.add_argument(
        "--user-class",
        action="append",
        default=[],
        choices=["ProxyChatUser", "TritonGrpcUser"],
        help="restrict to these user classes (default: both, by weight)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/load"))
    args = parser.parse_args(argv)

    env = dict(os.environ)
    if args.model:
        env["DLM_LOAD_MODEL"] = args.model
    if args.triton_grpc:
        env["DLM_LOAD_TRITON_GRPC"] = args.triton_grpc
    if args.param:
        params = json.loads(env.get("DLM_LOAD_PARAMS", "") or "{}")
        for item in args.param:
            key, _, raw = item.partition("=")
            try:
                params[key] = json.loads(raw)
            except json.JSONDecodeError:
                params[key] = raw
        env["DLM_LOAD_PARAMS"] = json.dumps(params)

    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    worst = 0
    for users in [int(u) for u in args.users.split(",") if u.strip()]:
        code, stats = run_locust(users, args, env, args.out)
        if not stats.exists():
            print(f"   Locust wrote no stats (exit {code}); see {args.out}/u{users:03d}.log")
            worst = max(worst, 2)
            continue
        new = read_stats(stats, users)
        rows += new
        for r in new:
            if r.name == "all":
                print(
                    f"   {r.requests} requests, {r.failures} failures, "
                    f"{r.requests_per_s:.2f} req/s, {r.tokens_per_s:.1f} tokens/s"
                )
        worst = max(worst, code)
    write_summary(rows, args.out / "summary.csv")
    plot_summary(rows, args.out / "summary.png", f"dlm-triton load: {args.host}")
    print(f"wrote {args.out / 'summary.csv'} and {args.out / 'summary.png'}")
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
