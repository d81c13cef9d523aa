"""Planning a module that is not a zoo model: its run of calls as a chain (``spine.py``), nested
blocks (``nesting.py``) and the plan over its blocks (``plan_module.py``)."""
