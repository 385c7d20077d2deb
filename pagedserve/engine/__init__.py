"""The in-process engine: the scheduler's core and the worker's model runner in one loop, for
`generate`, `chat`, the benches and the tests. It may import any service's plain classes."""

from pagedserve.engine.llm_engine import (CompletedSample, EngineConfig, LLMEngine, RequestOutput,
                                          engine_config_from_args)

__all__ = ["CompletedSample", "EngineConfig", "LLMEngine", "RequestOutput", "engine_config_from_args"]
