"""Being written: see issue 3."""
