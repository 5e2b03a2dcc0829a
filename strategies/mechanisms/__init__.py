"""Privacy mechanisms: wrappers around a base algorithm, each with its ledger events."""
