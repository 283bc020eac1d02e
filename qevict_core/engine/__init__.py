"""The QEvict engine: the three-tier cache, its budget, ledger, routing and window scoring."""
