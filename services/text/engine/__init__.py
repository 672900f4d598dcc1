"""The text engine: paged KV cache, continuous-batching scheduler, sampler and incremental detokenizer."""

from services.text.engine.async_engine import AsyncLLMEngine
from services.text.engine.engine import EngineConfig, LLMEngine
from services.text.engine.params import Delta, EngineOverloaded, PromptTooLong, SamplingParams, TokenLogprob

__all__ = ["AsyncLLMEngine", "Delta", "EngineConfig", "EngineOverloaded", "LLMEngine", "PromptTooLong",
           "SamplingParams", "TokenLogprob"]
