"""Serve a model over an OpenAI-compatible HTTP API with continuous batching.

`tqjax-serve -m smollm2-135m-instruct --kv turbo4 --slots 4 --port 8080` (or
`python scripts/serve.py ...`).

FastAPI + uvicorn (`tqjax.serve.server`); the engine (`tqjax.serve.engine`) keeps `--slots`
cache rows of `--ctx-size` positions and batches every running request into one decode step.
Binds to 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tqjax.cli import ArgumentParser, add_model_args, cache_spec, model_mesh, run_main
from tqjax.errors import TqjaxError


def parse_args(argv: list[str] | None = None) -> object:
    p = ArgumentParser(prog="tqjax-serve", description=__doc__.split("\n\n")[0])
    add_model_args(p, batches=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
    p.add_argument("--slots", "-np", type=int, default=4,
                   help="cache rows: requests decoded together (default 4)")
    p.add_argument("--ctx-size", "-c", type=int, default=2048,
                   help="positions per slot (prompt + generated; default 2048)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a busy slot before a 429 (default 64; 0: "
                        "only free slots take requests)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (except /health)")
    p.add_argument("--slot-save-path", default=None,
                   help="directory for POST /slots/{id}?action=save|restore files")
    p.add_argument("--alias", default=None, help="model id reported by /v1/models")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body, bytes (default 1 MiB; larger gets a 413)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/Ctrl-C, let running requests finish for up to S seconds, "
                        "then cancel them (default 10)")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    """Serve until interrupted; returns the exit status (user errors raise TqjaxError)."""
    args = parse_args(argv)
    try:
        import uvicorn

        from tqjax.serve.server import Server, create_app
    except ModuleNotFoundError as e:  # (the base install has no web stack)
        raise TqjaxError(f"tqjax-serve needs the serve extra (no module {e.name!r}): "
                         f"pip install 'tqjax[serve]'") from None

    import tqjax
    from tqjax.serve.engine import Engine

    spec = cache_spec(args)  # (--backend is resolved by the Engine, once JAX has started)
    if not 0 < args.port < 65536:
        raise tqjax.TqjaxError(f"--port must be in 1..65535, got {args.port}")
    if args.slots < 1 or args.max_queue < 0:
        raise tqjax.TqjaxError("--slots must be >= 1 and --max-queue >= 0")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        raise tqjax.TqjaxError(f"--slot-save-path {args.slot_save_path} is not a directory")
    if not args.shutdown_grace >= 0:
        raise tqjax.TqjaxError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if args.max_body_bytes < 1:
        raise tqjax.TqjaxError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    sock = bind(args.host, args.port)  # before minutes of loading: a taken port fails now
    mesh = model_mesh(args)  # --tp/--dp: the model and the slots' cache rows are sharded
    model = tqjax.load(args.model, dtype=args.dtype, weights=args.weights, bpw=args.bpw,
                       quantize_embeddings=args.quantize_embeddings, progress=True, mesh=mesh)
    engine = Engine(model, spec, slots=args.slots, ctx_size=args.ctx_size,
                    max_queue=args.max_queue, backend=args.backend)
    server = Server(engine, args.alias or Path(str(args.model)).name, api_key=args.api_key,
                    slot_save_path=args.slot_save_path, max_body_bytes=args.max_body_bytes)
    # uvicorn waits up to the grace for open connections (streams), then cancels them; the
    # engine then drains what is left for up to the grace as well
    config = uvicorn.Config(create_app(server, shutdown_grace_s=args.shutdown_grace),
                            log_level="warning", timeout_graceful_shutdown=args.shutdown_grace)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (uvicorn listens on it), or a one-line TqjaxError."""
    from tqjax.errors import TqjaxError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise TqjaxError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise TqjaxError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    """Entry point `tqjax-serve`: one-line errors, exit 2 on bad input."""
    run_main(lambda: run(argv))


if __name__ == "__main__":
    main()
