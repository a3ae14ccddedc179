"""`python -m dlm_engine.parallel.node_main --leader HOST[:PORT] --node K`: one host's ranks of a
tensor-parallel group that spans several hosts (node.py; `dlm-triton tp-node` runs the same)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from .node import DEFAULT_PORT, WAIT_S, parse_leader, run_node


def build_parser() -> argparse.ArgumentParser:
    """The node's flags (`dlm-triton tp-node` has the same)."""
    parser = argparse.ArgumentParser(prog="python -m dlm_engine.parallel.node_main")
    parser.add_argument(
        "--leader",
        required=True,
        metavar="HOST[:PORT]",
        help=f"rank 0's host and its tensor_parallel_port (default port {DEFAULT_PORT})",
    )
    parser.add_argument("--node", required=True, type=int, metavar="K", help="1..nodes-1")
    parser.add_argument("--wait", type=float, default=WAIT_S, metavar="SECONDS")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the node until its group stops; SIGTERM stops its workers first."""
    logging.basicConfig(level=logging.WARNING)
    try:
        host, port = parse_leader(args.leader)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through run_node's stop of the workers

    signal.signal(signal.SIGTERM, terminate)
    try:
        return run_node(host, port, args.node, args.wait)
    except (OSError, ValueError, RuntimeError) as exc:  # torch's store errors: RuntimeError
        print(f"error: tensor-parallel node {args.node}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
