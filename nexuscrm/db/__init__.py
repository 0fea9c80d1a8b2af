"""Database layer: engine factory, dialect helpers, the ``_System_*`` tables."""
