"""``dlm-triton``: ``serve`` a model on tritonserver (+ OpenAI proxy), ``generate`` against it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dlm_protocol import PARAMS, Param, settings
from dlm_protocol.params import ALGORITHM_SUMMARIES
from dlm_triton.launch.launcher import (
    DEFAULT_MODEL,
    EMBEDDED_COMPANIONS,
    Ports,
    StartAborted,
    TritonServerProcess,
    embedded_companions,
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, unless the flag has none (None, off, empty) or
    its help already names it; the epilog keeps its line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="start tritonserver (and the OpenAI proxy) for a model",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"checkpoint directory, hub id, or name in model_repository/ (default {DEFAULT_MODEL})",
    )
    also = p.add_mutually_exclusive_group()
    also.add_argument(
        "--also",
        action="append",
        metavar="NAME",
        help="one more model of model_repository/ for the same tritonserver (repeatable; only "
        "beside a model of model_repository/); default without --model: the embedded "
        f"{', '.join(EMBEDDED_COMPANIONS)} where present",
    )
    also.add_argument(
        "--no-also", action="store_true", help="serve the main model only (no companions)"
    )
    p.add_argument(
        "--model-name",
        help="Triton model name for a checkpoint directory or hub id (default: its last "
        "path part, lower-cased)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the model runs (auto: cuda when a GPU is visible)",
    )
    for setting in settings.serve_flags():  # one flag per server setting
        _setting_flag(p, setting)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="GPUs only: N engine replicas (Triton instances) of each model, each on its own "
        "group of tensor_parallel_size GPUs, new requests to the least busy (env "
        "DLM_DATA_PARALLEL_SIZE; default: as many groups as the visible GPUs hold)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in Docker)")
    p.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port")
    p.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port")
    p.add_argument("--proxy-port", type=int, default=9000, help="OpenAI proxy port")
    p.add_argument("--no-proxy", action="store_true", help="serve Triton only")
    p.add_argument("--gpu-metrics", action="store_true", help="force --allow-gpu-metrics")
    p.add_argument("--exit-timeout", type=int, default=10, help="Triton's exit timeout (s)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="model load limit (s)")
    p.add_argument("--log-file", type=Path, help="tritonserver log (default: this terminal)")
    p.add_argument("--verbose", action="store_true", help="tritonserver --log-verbose=1")
    p.add_argument(
        "--admin-key-file",
        type=Path,
        help="key for Triton's admin APIs (default ~/.cache/dlm-triton/admin-key, generated)",
    )
    p.add_argument(
        "--no-restrict-admin",
        action="store_true",
        help="leave Triton's model control, logging, trace and shm APIs open",
    )


_SETTING_TYPES = {"int": int, "float": float, "str": str}


def _setting_flag(parser: argparse.ArgumentParser, setting: settings.Setting) -> None:
    """A ``serve`` flag that sets ``setting`` (absent: the model's ``config.pbtxt``)."""
    default = setting.default_text.replace("`", "")
    help_text = (
        f"{setting.doc.replace('`', '')} (default: the model's config.pbtxt, else {default})"
    )
    kw: dict[str, Any] = {
        "dest": setting.name,
        "default": None,
        "help": help_text.replace("%", "%%"),
    }
    if setting.kind == "bool":
        parser.add_argument(setting.flag, action=argparse.BooleanOptionalAction, **kw)
        return
    if setting.choices:
        kw["choices"] = list(setting.allowed)
    else:
        kw["metavar"] = setting.kind.upper()
    parser.add_argument(setting.flag, type=_SETTING_TYPES[setting.kind], **kw)


def served_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings given as ``serve`` flags, by config parameter name, as config text."""
    given = {s: getattr(args, s.name) for s in settings.serve_flags()}
    return {s.param: s.text(v) for s, v in given.items() if v is not None}


def _algorithms_epilog() -> str:
    width = max(len(name) for name in ALGORITHM_SUMMARIES)
    lines = [f"  {name:<{width}}  {text}" for name, text in ALGORITHM_SUMMARIES.items()]
    return "algorithms (--algorithm):\n" + "\n".join(lines)


def _generate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="send one prompt to a running server",
        formatter_class=_HelpFormatter,
        epilog=_algorithms_epilog(),
    )
    p.add_argument("prompt")
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    p.add_argument(
        "--http-url", help="Triton HTTP base (with --http; default: --url's host, port 8000)"
    )
    p.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the Triton model to ask")
    p.add_argument("--stream", action="store_true", help="print deltas as they commit")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="apply the chat template (default)")  # fmt: skip
    mode.add_argument("--raw", dest="chat", action="store_false",
                      help="send the prompt as it is, no template (default: off)")  # fmt: skip
    for param in PARAMS:  # one flag per request key of the contract
        _param_flag(p, param)
    p.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help="any request key as JSON, e.g. --param stop='[\"END\"]'")  # fmt: skip
    p.add_argument(
        "--json", action="store_true", help="print the final usage as JSON (stdout, last line)"
    )


_FLAG_TYPES = {"int": int, "float": float, "str": str, "json": str}  # json: JSON text


def _param_flag(parser: argparse.ArgumentParser, param: Param) -> None:
    flag = "--" + param.name.replace("_", "-")
    help_text = f"{param.doc.split('. ')[0].rstrip('.')}; {param.values_text()} "
    help_text = f"{help_text}(default: {param.default_doc})".replace("%", "%%")
    if param.kind == "bool":  # --x / --no-x; absent = not sent (the server's default)
        parser.add_argument(flag, dest=param.name, action=argparse.BooleanOptionalAction,
                            default=None, help=help_text)  # fmt: skip
    elif param.kind == "stop":
        parser.add_argument(flag, dest=param.name, action="append", metavar="TEXT",
                            help=help_text + "; repeatable")  # fmt: skip
    else:
        parser.add_argument(flag, dest=param.name, type=_FLAG_TYPES[param.kind],
                            metavar=param.kind.upper(), help=help_text)  # fmt: skip


def _download_parser(sub: Any) -> None:
    p = sub.add_parser(
        "download",
        help="fetch a model's checkpoint into the Hugging Face cache (HF_HOME), e.g. to pre-seed "
        "an air-gapped host; the same files serve downloads",
    )
    p.add_argument("model", help="a Hub id (org/name) or a name in model_repository/")
    p.add_argument("--revision", help="Hub branch, tag or commit (default: the model's, or main)")


def _tp_node_parser(sub: Any) -> None:
    """`python -m dlm_engine.parallel.node_main`'s flags (written here too: building this
    parser must not import torch)."""
    p = sub.add_parser(
        "tp-node",
        help="run this host's ranks of a tensor-parallel group whose rank 0 (`serve` with "
        "tensor_parallel_nodes > 1) runs on another host",
        formatter_class=_HelpFormatter,
    )
    port = settings.BY_NAME["tensor_parallel_port"].default
    p.add_argument(
        "--leader",
        required=True,
        metavar="HOST[:PORT]",
        help=f"rank 0's host and its tensor_parallel_port (default port {port})",
    )
    p.add_argument(
        "--node",
        required=True,
        type=int,
        metavar="K",
        help="this host's index, 1..tensor_parallel_nodes-1 (rank 0's host is node 0); it "
        "runs ranks K*size/nodes .. (K+1)*size/nodes-1",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="how long to wait for rank 0's store (rank 0 may still be downloading)",
    )


def tp_node(args: argparse.Namespace) -> int:
    """This host's ranks, until rank 0's engine stops (dlm_engine/parallel/node.py)."""
    from dlm_engine.parallel import node_main

    return node_main.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlm-triton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    _download_parser(sub)
    _tp_node_parser(sub)
    return parser


def download(args: argparse.Namespace) -> int:
    """Resolve the checkpoint the launcher would serve, and fetch it into the Hub cache."""
    import os

    from dlm_triton.launch.checkpoint_fetch import served_checkpoint
    from dlm_triton.launch.launcher import committed_repository

    checkpoint, revision = args.model, args.revision
    config = committed_repository() / args.model / "config.pbtxt"
    if config.exists():
        checkpoint, named = served_checkpoint(config, os.environ)
        revision = revision or named
    from dlm_engine.hub import is_hub_id, resolve_checkpoint

    if checkpoint is None or not is_hub_id(checkpoint):
        print(f"error: {args.model!r} names no Hub id ({checkpoint})", file=sys.stderr)
        return 2
    try:
        folder = resolve_checkpoint(checkpoint, revision)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def served_also(args: argparse.Namespace) -> list[str]:
    """The models served beside the main one: ``--also``; else, for the embedded default
    (no ``--model``), the embedded companions present; none with ``--no-also`` or ``--model``."""
    if args.also:
        return list(args.also)
    if args.no_also or args.model is not None:
        return []
    return embedded_companions()


def serve(args: argparse.Namespace) -> int:
    also = served_also(args)
    server = TritonServerProcess(
        args.model,
        model_name=args.model_name,
        device=args.device,
        engine_params=served_settings(args),
        ports=Ports(args.http_port, args.grpc_port, args.metrics_port, args.proxy_port),
        address=args.host,
        proxy=not args.no_proxy,
        log_path=args.log_file,
        ready_timeout_s=args.ready_timeout,
        exit_timeout_s=args.exit_timeout,
        gpu_metrics=True if args.gpu_metrics else None,
        die_with_parent=True,
        verbose=args.verbose,
        restrict_admin=not args.no_restrict_admin,
        admin_key_file=args.admin_key_file,
        also=also,
        data_parallel_size=args.data_parallel_size,
    )
    with_also = f" (also {', '.join(also)})" if also else ""
    print(
        f"starting tritonserver for {args.model or DEFAULT_MODEL}{with_also} ...", file=sys.stderr
    )
    server.install_signal_handlers()  # before start: a stop during loading cleans up too
    try:
        server.start()
    except StartAborted as exc:
        print(f"{exc}; stopped", file=sys.stderr)
        return 0
    except (FileNotFoundError, ValueError) as exc:  # no such model/checkpoint, corrupt shard
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # the server or the proxy did not come up
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready: {server.describe()}", flush=True)
    print(
        f"try: dlm-triton generate 'Hello' --model {server.model_name} "
        f"--url {server.urls['grpc']} --stream   (Ctrl-C stops)",
        flush=True,
    )
    for name in server.model_names[1:]:
        print(f"also served: --model {name}", flush=True)
    return server.serve_forever()


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    sampling = {p.name: getattr(args, p.name) for p in PARAMS if getattr(args, p.name) is not None}
    for item in args.param:
        key, _, value = item.partition("=")
        try:
            sampling[key] = json.loads(value)
        except json.JSONDecodeError:
            sampling[key] = value
    return sampling


def generate(args: argparse.Namespace) -> int:
    from dlm_client import DLMClient, DLMError

    client = DLMClient(args.url, args.model, http_url=args.http_url)
    prompt_kw: dict[str, Any] = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    chunks = (client.stream_http if args.http else client.stream)(
        stream=args.stream, **prompt_kw, **_sampling(args)
    )
    last = None
    try:
        for chunk in chunks:
            print(chunk.text, end="" if args.stream else "\n", flush=True)
            last = chunk
    except DLMError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    if args.stream:
        print()
    if last is None:
        return 0
    usage = {
        "finish_reason": last.finish_reason,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "steps": last.steps,
        "forwards": last.forwards,
        "tokens_per_forward": last.tokens_per_forward,
    }
    if args.json:
        print(json.dumps(usage))
    else:  # on stderr: stdout stays the completion alone
        print(
            f"[{usage['finish_reason']}: {usage['completion_tokens']} tokens in "
            f"{usage['forwards']} forwards, {usage['tokens_per_forward']:.2f} tokens/forward]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"serve": serve, "generate": generate, "download": download, "tp-node": tp_node}
    return commands[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
