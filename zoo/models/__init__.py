"""The model zoo: one file per family; importing this package registers every model."""
from . import bert, cifar_cnn, densenet, gpt2, resnet, vit  # noqa: F401  (registration)
from . import rev_bert, rev_vit, revnet  # noqa: F401  (registration)
from ._base import ZooModel
from ._registry import UnknownArgumentError, UnknownModelError, create_model, list_models, \
    register_model

__all__ = ["ZooModel", "UnknownModelError", "UnknownArgumentError", "create_model", "list_models",
           "register_model"]
