"""Rich renderers: each takes a result dataclass and returns renderables; nothing is computed here."""
