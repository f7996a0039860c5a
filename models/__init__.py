"""GPT-2 with attention routed per layer and head: `from models import GPT, ModelConfig`."""
from models.attention import attend, resolve_backend, route_name
from models.gpt import GPT, ModelConfig

__all__ = ["GPT", "ModelConfig", "attend", "resolve_backend", "route_name"]
