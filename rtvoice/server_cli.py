"""``rtvoice serve``: run the live TTS service with uvicorn (uvloop).

Every setting of ``rtvoice.settings`` is a flag (``--max-turn-frames``), grouped as in the
settings (network, model, engine, limits, voices), and also an environment variable
(``RTVOICE_MAX_TURN_FRAMES``). Flags win over the environment, which wins over defaults.
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from rtvoice import logs
from rtvoice.settings import (
    ENV_PREFIX,
    GROUP_TITLES,
    Settings,
    default_text,
    option_help,
    option_names,
    option_type,
    parse_value,
)

__all__ = ["add_serve_parser", "serve"]

log = logging.getLogger("rtvoice.serve")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``rtvoice``'s argparse subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="run the realtime TTS WebSocket service",
        description="Serve /v1/tts/live (Fish Audio compatible), the voices API, /health, "
        "/ready and /metrics. With no arguments: the built-in 'tiny' model (random "
        "weights) on the CPU at 127.0.0.1:8000. Real speech: --model /path/to/s2-pro "
        "--device cuda. Every flag can also be set as an environment variable "
        f"({ENV_PREFIX}<FLAG>, e.g. {ENV_PREFIX}PORT=9000).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for group, names in option_names().items():
        g = p.add_argument_group(GROUP_TITLES.get(group, group))
        for name in names:
            base, _ = option_type(name)
            flag = "--" + name.replace("_", "-")
            env = f"{ENV_PREFIX}{name.upper()}"
            help_ = f"{option_help(name)} [env {env}; default {default_text(name)}]"
            help_ = help_.replace("%", "%%")  # argparse formats help strings
            if base is bool:
                g.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=help_,
                )
            else:
                g.add_argument(
                    flag, dest=name, metavar=name.upper(), type=_parser_for(name),
                    default=argparse.SUPPRESS, help=help_,
                )
    p.set_defaults(fn=serve)
    return p


def _parser_for(name: str) -> Any:
    def parse(raw: str) -> Any:
        try:
            return parse_value(name, raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name  # argparse names the type in its error messages
    return parse


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C / SIGTERM: graceful shutdown)."""

    from rtvoice.app import Server, create_app, uvicorn_config

    names = {n for ns in option_names().values() for n in ns}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    settings = Settings.from_env(**overrides)
    m, net = settings.model, settings.network
    logs.setup(net.log_format, net.keys())
    if net.gpus is not None or net.replicas > 1:  # several engine processes behind nginx
        from rtvoice.replicas import serve_replicas

        return serve_replicas(settings, overrides)
    if m.is_preset:
        log.warning(
            "serving the built-in %r model with RANDOM WEIGHTS: it exercises the whole pipeline "
            "(prefill, streaming, formats, voices) but does not speak; its audio is noise. For "
            "real speech, point it at S2-Pro weights: rtvoice serve --model /path/to/s2-pro "
            "--device cuda",
            m.model,
        )
    app = create_app(settings)
    host = f"[{net.host}]" if ":" in net.host else net.host
    log.info(
        "rtvoice: live TTS at ws://%s:%d/v1/tts/live, voices at http://%s:%d/v1/voices "
        "(model %s on %s; data dir %s)",
        host, net.port, host, net.port, m.model, m.device, settings.voices.data_dir,
    )
    # uvicorn drains on SIGTERM, then raises the signal again under the handler found at
    # start: this one makes that a clean exit (status 0) rather than death by signal.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server = Server(uvicorn_config(app, settings), app)
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl-C, then re-raises the signal; that is a normal
        # exit for a server, not a crash.
        log.info("rtvoice: stopped")
    return server.exit_code


def _exit_cleanly(signum: int, frame: Any) -> None:
    log.info("rtvoice: stopped (signal %d)", signum)
    raise SystemExit(0)
