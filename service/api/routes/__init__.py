"""One module per resource; ``PUBLIC_PATHS`` are the only routes served without a key."""

PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})
