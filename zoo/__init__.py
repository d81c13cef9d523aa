"""zoo: memory-efficient, checkpoint-ready models for PyTorch, with a checkpoint that is exactly
the plain model (same gradients, BatchNorm statistics and random numbers), only lighter."""
from . import memory, nn, reversible
from .checkpoint import checkpoint, checkpoint_sequential, is_recomputing, offload
from .models import ZooModel, create_model, list_models, register_model
from .planner import plan
from .integrations import set_grad_checkpointing
from .nn import cp_BatchNorm1d, cp_BatchNorm2d, cp_BatchNorm3d, cp_SyncBatchNorm

__version__ = "0.1.0"
__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing", "reversible", "cp_BatchNorm1d",
           "cp_BatchNorm2d", "cp_BatchNorm3d", "cp_SyncBatchNorm", "memory", "nn", "ZooModel",
           "create_model", "list_models", "register_model", "plan", "set_grad_checkpointing",
           "offload"]
