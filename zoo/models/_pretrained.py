"""``pretrained=True``: torchvision's ImageNet weights for the zoo's ImageNet DenseNets and ResNets.

The zoo's ImageNet models have torchvision's submodule names, so torchvision's published weights
load strictly. They are found through torchvision's weight enums (which know each file's URL) and
read from torch's hub cache (``torch.hub.get_dir()/checkpoints/<file>``, where torchvision keeps
them too); a missing file is downloaded when the network allows and ``ZOO_OFFLINE`` is unset.
"""
from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlparse

import torch
from torch import nn

__all__ = ["TORCHVISION_WEIGHTS", "weights_file", "load_pretrained"]

# zoo name -> torchvision weight enum (its DEFAULT member is loaded)
TORCHVISION_WEIGHTS = {
    "resnet18": "ResNet18_Weights", "resnet34": "ResNet34_Weights", "resnet50": "ResNet50_Weights",
    "resnet101": "ResNet101_Weights", "resnet152": "ResNet152_Weights",
    "densenet121": "DenseNet121_Weights", "densenet161": "DenseNet161_Weights",
    "densenet169": "DenseNet169_Weights", "densenet201": "DenseNet201_Weights",
}
# torchvision's DenseNet files use the pre-0.3 names "norm.1"/"conv.2"; its loader renames them
_OLD_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.(?:weight|bias|"
                               r"running_mean|running_var|num_batches_tracked))$")


def _weights(name: str):
    """torchvision's default weights entry for ``name`` (one line saying why not, otherwise)."""
    if name not in TORCHVISION_WEIGHTS:
        raise ValueError(f"no pretrained weights for {name!r}: pretrained=True loads torchvision's "
                         f"ImageNet weights, which exist for {', '.join(TORCHVISION_WEIGHTS)}")
    import torchvision

    return getattr(torchvision.models, TORCHVISION_WEIGHTS[name]).DEFAULT


def weights_file(name: str) -> tuple[str, str]:
    """(URL, local path in torch's hub cache) of ``name``'s torchvision weights."""
    url = _weights(name).url
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(url).path))
    return url, path


def _reachable(url: str, timeout: float = 3.0) -> bool:
    if os.environ.get("ZOO_OFFLINE", "") not in ("", "0"):
        return False
    try:
        socket.create_connection((urlparse(url).hostname, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _state_dict(name: str) -> dict[str, torch.Tensor]:
    url, path = weights_file(name)
    if not os.path.exists(path):
        if not _reachable(url):
            raise FileNotFoundError(
                f"pretrained weights for {name!r} are not cached and the network is unavailable: "
                f"fetch {url} and save it as {path}")
        torch.hub.download_url_to_file(url, path, progress=False)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {_OLD_DENSENET_KEY.sub(r"\1\2", k): v for k, v in state.items()}


def _misfit(model: nn.Module, state: dict[str, torch.Tensor], head: str | None) -> str:
    """What keeps ``state`` from loading into ``model``, in one line ("" when it fits): tensors
    missing from it (``head``'s keys excepted), unexpected ones, and ones of another shape."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not (head and k.startswith(head))]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in state if k in own and own[k].shape != state[k].shape]
    if not (missing or unexpected or shapes):
        return ""
    if shapes:
        k = shapes[0]
        first = f"{k} is {tuple(state[k].shape)} in the weights, {tuple(own[k].shape)} here"
    else:
        first = f"first: {(missing or unexpected)[0]}"
    return (f"{len(shapes)} tensors of another shape, {len(missing)} missing from the weights, "
            f"{len(unexpected)} not in the model ({first})")


def load_pretrained(model: nn.Module, name: str, arguments: dict | None = None) -> nn.Module:
    """Load torchvision's ImageNet weights into ``model`` (built as ``name``, with the
    architecture ``arguments`` given to create_model), strictly; with another ``num_classes``
    (0 included) every weight but the classifier's (timm's way). Arguments that change the
    network (``layers``, ``growth_rate``) are refused in one line, before anything is loaded;
    ones that keep its tensors (``drop_rate``, ``checkpoint_every``) load as timm's do."""
    state = _state_dict(name)
    if getattr(model, "in_chans", 3) != 3:
        raise ValueError(f"pretrained weights for {name!r} take 3 input channels; build the model "
                         f"with in_chans=3 (got {model.in_chans})")
    head = model.classifier_name + "." if model.num_classes != 1000 else None
    if head:
        state = {k: v for k, v in state.items() if not k.startswith(head)}
    misfit = _misfit(model, state, head)
    if misfit:
        given = ", ".join(f"{k}={v!r}" for k, v in (arguments or {}).items()
                          if k not in ("num_classes", "efficient")) or "no architecture arguments"
        raise ValueError(f"pretrained weights for {name!r} do not fit the model built with "
                         f"{given}: {misfit}; they fit {name!r} as registered")
    model.load_state_dict(state, strict=head is None)
    model.weights_name = str(_weights(name))
    return model
