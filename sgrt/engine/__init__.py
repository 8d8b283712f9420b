"""The serving engine: request API, scheduler, KV pool, radix cache, model runner, sampler."""
from __future__ import annotations

from sgrt.engine.client import EngineClient, EngineInfo
from sgrt.engine.engine import Engine, EngineConfig
from sgrt.engine.handle import RequestHandle
from sgrt.engine.outputs import Result, StreamChunk
from sgrt.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineClient", "EngineConfig", "EngineInfo", "RequestHandle", "Result", "SamplingParams", "StreamChunk"]
