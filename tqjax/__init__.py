"""tqjax: Llama and Qwen language models in JAX with TurboQuant compression."""

from tqjax.api import Model, generate, load, logits
from tqjax.decode.generate import GenerationResult
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec

__all__ = ["CacheSpec", "GenerationResult", "Model", "TqjaxError", "generate", "load", "logits"]
__version__ = "0.1.0"
