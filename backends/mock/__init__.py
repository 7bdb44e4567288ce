"""Mock LLM inference engines (openai, dynamo, vllm, sglang) as real HTTP/1.1 servers.

Strategy: pure per-engine rules (`flavours`, `tables`, `inputs`, `queue`,
`responses`, `routes`) under a small asyncio/h11 socket layer (`server`);
tests drive and inspect an engine through `/test-control` or the
`MockEngine` methods.
"""

from backends.mock.options import ENGINE_FLAVOURS, MockEngineOptions
from backends.mock.server import MockEngine, serve_forever

__all__ = ["ENGINE_FLAVOURS", "MockEngine", "MockEngineOptions", "serve_forever"]
