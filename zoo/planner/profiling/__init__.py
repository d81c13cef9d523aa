"""What each unit of a chain costs: an instrumented fake step (``trace.py``), repeated units
profiled once (``repeats.py``), the runs that show each unit in every context (``contexts.py``),
the profile itself (``profile.py``, its record ``chain_profile.py``) and measured times
(``timing.py``)."""
