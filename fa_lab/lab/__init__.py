"""The interactive lab: figures (``viz``), dashboards (``widgets``), the atlas of sweeps
(``atlas``) and the lessons' helpers (``lessons``)."""
