"""tqjax: Llama and Qwen language models in JAX with TurboQuant compression."""

# first: sets tqjax's XLA flags before anything starts XLA (XLA reads them once)
from tqjax import xla  # noqa: F401  # isort: skip
from tqjax.api import Model, Session, generate, load, logits
from tqjax.decode.generate import GenerationResult
from tqjax.errors import TqjaxError
from tqjax.kv.cache import CacheSpec
from tqjax.planner import plan
from tqjax.sharding import make_mesh

__all__ = ["CacheSpec", "GenerationResult", "Model", "Session", "TqjaxError", "generate", "load",
           "logits", "make_mesh", "plan"]
__version__ = "0.1.0"
