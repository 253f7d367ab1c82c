"""Continuous batching on a paged KV cache (``model.generate_batch``, ``model.init_continuous_batching``)."""

from kvgen.serving.engine import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, QueueFull
from kvgen.serving.scheduler import RequestStatus

__all__ = ["ContinuousBatchingConfig", "ContinuousBatchingManager", "GenerationOutput", "QueueFull", "RequestStatus"]
