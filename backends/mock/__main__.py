"""Command line for a stand-alone mock engine: `python -m backends.mock --engine vllm`.

Strategy: flags map one-to-one onto `MockEngineOptions` fields; the engine
runs until interrupted and prints its URL once it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import fields

from backends.mock.options import ENGINE_FLAVOURS, MockEngineOptions
from backends.mock.server import MockEngine, serve_forever


def parse_args(argv: list[str] | None = None) -> tuple[MockEngineOptions, str, int]:
    parser = argparse.ArgumentParser(prog="python -m backends.mock")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    for spec in fields(MockEngineOptions):
        flag = "--" + spec.name.replace("_", "-")
        if spec.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default)
        else:
            convert = {"int": int, "float": float, "int | None": int}.get(str(spec.type), str)
            choices = ENGINE_FLAVOURS if spec.name == "engine" else None
            parser.add_argument(flag, type=convert, default=spec.default, choices=choices)
    args = vars(parser.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    return MockEngineOptions(**args), host, port


def _announce(engine: MockEngine) -> None:
    print(f"mock {engine.options.engine} engine listening on {engine.url}", flush=True)


def main(argv: list[str] | None = None) -> None:
    options, host, port = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(options, host, port, on_ready=_announce))


if __name__ == "__main__":
    main()
