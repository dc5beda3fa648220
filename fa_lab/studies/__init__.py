"""Studies built on the core: parameter sweeps (``sweep``), the onset predictor (``onset``),
the adversarial search (``adversary``), the benchmark (``bench``) and the bug report's
tables (``experiments``)."""
