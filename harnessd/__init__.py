"""harnessd: the harness side: client library, launcher, agent loop and ledger sync."""
