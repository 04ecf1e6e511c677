"""execd: the workspace worker that serves shell, files, services, watches and the ledger."""
