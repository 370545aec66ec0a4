"""tqjax: Llama and Qwen language models in JAX with TurboQuant compression."""

from tqjax.api import Model, Session, generate, load, logits
from tqjax.decode.generate import GenerationResult
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec
from tqjax.planner import plan
from tqjax.sharding import make_mesh

__all__ = ["CacheSpec", "GenerationResult", "Model", "Session", "TqjaxError", "generate", "load",
           "logits", "make_mesh", "plan"]
__version__ = "0.1.0"
