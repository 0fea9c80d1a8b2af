"""Database layer: engine factory, dialect helpers, the ``_System_*`` tables.

Importing it registers the DDL rules of :mod:`nexuscrm.db.ddl` (every MySQL
table is created ``utf8mb4``).
"""

from nexuscrm.db import ddl as ddl
