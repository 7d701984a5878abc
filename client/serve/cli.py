"""``kvpool serve``: an OpenAI-compatible HTTP server for a local transformers model, its KV in kvpoold."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from ..crash_stacks import show_stacks_on_native_crash
from .limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS, ServeLimits


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a local transformers model directory (nothing is downloaded)")
    p.add_argument("--socket", default=None,
                   help="kvpoold's socket (default: $KVPOOL_SOCKET or /run/kvpoold/kvpoold.sock)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | float32 | float16 | bfloat16")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: the directory's)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per pool block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in one step")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output (default: the model's)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (default on a GPU: CUDA graphs, one per batch-size bucket)")
    p.add_argument("--fused-layers", choices=("auto", "on", "off"), default="auto",
                   help="run Llama / Mistral / Qwen2 layers through kvpool.fused (merged matmuls, one kernel per "
                        "norm, RoPE and SiLU-gate); auto: on a GPU where the model is one of them")
    p.add_argument("--overlap-steps", choices=("auto", "on", "off"), default="auto",
                   help="queue each step on the GPU before reading the last one's tokens back, so host work runs "
                        "beside the GPU; auto: on a GPU, off on the CPU")
    p.add_argument("--model-id", default=None,
                   help="the pool layout's model id (default: the directory's name; its files make the revision)")
    p.add_argument("--name", default=None, help="this process's name in kvpoolctl clients")
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the largest request body read; larger ones get 413 unread "
                        f"(default: {DEFAULT_MAX_BODY_BYTES}, 2 MiB)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests waiting for a place in the batch (being tokenized or queued) beyond which new "
                        f"ones get 429 with Retry-After (default: {DEFAULT_MAX_WAITING_REQUESTS})")


#: an ``auto`` / ``on`` / ``off`` option as the engine's ``None`` / ``True`` / ``False``
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def serve(args: argparse.Namespace) -> int:
    """Load the model, attach to kvpoold, serve HTTP until SIGINT / SIGTERM."""
    import uvicorn

    from kvpool.engine import Engine, EngineConfig

    from .app import build_app
    from .loader import load_model, weights_fingerprint

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = str(Path(args.model).resolve())
    name = args.served_model_name or Path(path).name
    model, tokenizer = load_model(path, dtype=args.dtype, device=args.device)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, cuda_graphs=not args.enforce_eager,
                          fused_layers=AUTO_ON_OFF[args.fused_layers], overlap_steps=AUTO_ON_OFF[args.overlap_steps])
    engine = Engine.connect(model, args.socket, name=args.name or f"kvpool-serve-{name}-{os.getpid()}",
                            model_id=args.model_id or Path(path).name, revision=weights_fingerprint(path),
                            block_size=args.block_size, tokenizer=tokenizer, config=config)
    try:
        engine.warm_up().start()
        limits = ServeLimits(max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests)
        app = build_app(engine, name, limits)
        print(f"kvpool serve: {name} on http://{args.host}:{args.port} (pool: {engine.client.backend}, "
              f"swap to host tier: {engine.swap})", flush=True)
        # uvicorn shuts down on SIGINT / SIGTERM and then raises the signal again for the handler it
        # found; a no-op one lets this process detach from the daemon and exit 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``kvpool`` console script: ``kvpool serve ...``."""
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool model processes")
    sub = p.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs kvpool[serve])"))
    args = p.parse_args(argv)
    show_stacks_on_native_crash()
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
