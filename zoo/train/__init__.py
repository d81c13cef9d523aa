"""The training run behind ``train.py``: configs and their checks (:mod:`.config`), datasets
(:mod:`.data`), the model, optimizer and devices (:mod:`.setup`), the run directory with its
lock, atomic checksummed files and resume (:mod:`.run_dir`, :mod:`.run_lock`, :mod:`.run_state`),
signals (:mod:`.stopping`), the loop itself as named steps (:mod:`.loop`), and the command that
runs it, ``python train.py`` or the installed ``zoo-train`` (:mod:`.cli`)."""
from .config import ConfigError, TrainConfig, resolve_config
from .loop import RunStopped, fit
from .run_dir import load_checkpoint

__all__ = ["ConfigError", "RunStopped", "TrainConfig", "fit", "load_checkpoint", "resolve_config"]
