"""The schedules a profile allows and their costs: the one-level memory model
(``one_level.py``), multi-level schedules (``multi_level.py``) and their search (``front.py``),
op-level save sets (``savesets.py``) and a model's hand modes as candidates (``modes.py``)."""
